// Attention of a ragged batch's new tokens to their own cache slots, every sequence and head in one call.
//
// Each (query row, head) is computed on its own, by one fixed loop over the key columns that row may see, in
// column order: what a row gets depends on its query and on the keys and values it sees, never on how many rows or
// sequences share the call or on where in the slot its visible new columns lie.  So a row's output is bitwise the
// same alone (plain decoding), in a draft's chain, in a tree (its ancestors' columns are visited in order, as plain
// decoding of its branch would have cached them one after another) or in a batch: batch and row invariant by
// construction.  See specdecode/models/attention_kernel.py for where it is used.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vector16.h"

namespace {

using namespace specdecode;

// w[0..count) = e^(w - max w), returning their sum: blocks of 16 (the last one padded), summed lane-wise in order and
// then by sum16, so the result depends on the numbers and their count only.  Whole blocks are loaded and stored as
// vectors; only the last, partial one goes through a padded copy.
inline float softmax_numerators(float* w, int64_t count) {
  const int64_t whole = count - count % 16;
  const v16 lowest = splat(-std::numeric_limits<float>::infinity());
  v16 top = lowest;
  for (int64_t c = 0; c < whole; c += 16) {
    top = maximum(top, load16(w + c));
  }
  if (whole < count) {
    v16 block = lowest;
    std::memcpy(&block, w + whole, sizeof(float) * (count - whole));
    top = maximum(top, block);
  }
  float largest = top[0];
  for (int l = 1; l < 16; ++l) largest = std::max(largest, top[l]);
  v16 total{};
  for (int64_t c = 0; c < whole; c += 16) {
    const v16 block = exp16(load16(w + c) - largest);
    total += block;
    std::memcpy(w + c, &block, sizeof block);
  }
  if (whole < count) {
    const int64_t lanes = count - whole;
    v16 block = splat(largest);  // padding lanes: e^0, left out of the sum below
    std::memcpy(&block, w + whole, sizeof(float) * lanes);
    block = exp16(block - largest);
    block = first_lanes(block, static_cast<int32_t>(lanes));
    total += block;
    std::memcpy(w + whole, &block, sizeof(float) * lanes);
  }
  return sum16(total);
}

// Keys and values are read a column at a time, and a row's columns are mostly whole stretches of memory read once: the
// row `PREFETCH_KEYS` columns ahead is asked for early, which made a decoding step's attention of 8 sequences at
// 400-600 cached positions ~1.6x faster on a 2-core AVX-512 EPYC (docs/results/panel-linear-smollm2-135m/README.md).
constexpr int64_t PREFETCH_KEYS = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / sizeof(T)) __builtin_prefetch(row + i);
}

// The columns one row sees, in column order: cached ones [first_cached, past), then the new tokens' listed in `news`.
struct Columns {
  int64_t first_cached, cached;
  std::vector<int64_t> news;
  int64_t count() const { return cached + static_cast<int64_t>(news.size()); }
  int64_t operator[](int64_t c) const { return c < cached ? first_cached + c : news[c - cached]; }
};

// One query row of a work item: its heads' queries (G x dim floats, fp32), the columns it sees, and its scores
// (G x columns.count(), then its softmax numerators).
struct QueryRow {
  int64_t row;
  Columns columns;
  std::vector<float> q, weights;
};

// Columns scored or summed together: the keys of a tile are read from the L1 cache by every row and head of an item
// after the first.
constexpr int64_t TILE = 16;

// Rows of one sequence attended together: their scores share each tile of keys (a draft's rows see the same cached
// columns).  More rows than this are split between work items, so that one long draft spreads over the threads.
constexpr int64_t ROWS_PER_ITEM = 4;

// Where the scores of a tile's column j are read: `columns` from c0 on, a tail repeating its last column.  A tile of
// cached columns is one stretch of memory (most tiles: no column list to look up).
template <typename T>
struct TileKeys {
  const T* first;  // the tile's first key where its columns are one stretch, else nullptr
  const T* kp;
  const Columns& columns;
  int64_t c0, count, dim;

  TileKeys(const T* kp, const Columns& columns, int64_t c0, int64_t dim)
      : first(c0 + TILE <= columns.cached ? kp + (columns.first_cached + c0) * dim : nullptr),
        kp(kp),
        columns(columns),
        c0(c0),
        count(std::min<int64_t>(TILE, columns.count() - c0)),
        dim(dim) {}

  const T* operator[](int64_t j) const {
    return first != nullptr ? first + j * dim : kp + columns[c0 + std::min(j, count - 1)] * dim;
  }
};

// The tile's scores (times `scaling`) from their lane sums (`partial`, a column each) into w: each score is q . k
// summed as before any change of this kernel's layout (lanes over the dimensions, the dimensions' blocks in order, the
// lanes by sum16's pairs), sixteen columns' lane sums at once by sums16.  A whole tile is copied with a size the
// compiler knows (one vector store); one copy of a size known only at run time went through `rep movsq` for every
// tile, about a tenth of the kernel's time at 16 rows after 300 positions
// (docs/results/attention-score-stores-epyc-smollm2-135m).
inline void store_scores(const v16 (&partial)[TILE], float scaling, int64_t count, float* w) {
  const v16 scores = sums16(partial) * scaling;
  if (count == TILE) {
    std::memcpy(w, &scores, sizeof scores);
  } else {
    std::memcpy(w, &scores, sizeof(float) * count);
  }
}

// A row's scores for G heads of BLOCKS x 16 dimensions (q: the G heads' queries, one after another; w: head g's at
// w + g * seen) against the columns [c0, c0 + TILE) it sees (fewer at its end), the heads' queries in registers and
// each column's key loaded once for all of them: for head g, q's first block times the key's, then each further
// block's product added, in order, the first product rounded on its own (keep_rounded keeps the compiler from fusing
// it into the next multiply-add), as score_tile's loop over any size rounds it.  Loading a key once for the three
// query heads of each of SmolLM2's key heads made one layer's attention of 16 rows 1.4x faster after 300 positions
// and 1.8x after 1,000 on a 2-core AVX-512 EPYC (docs/results/attention-shared-keys-epyc-smollm2-135m).
template <int G, int BLOCKS, typename T>
__attribute__((always_inline)) inline void score_tile_heads(const float* q, const TileKeys<T>& keys, float scaling,
                                                            float* w, int64_t seen) {
  v16 qb[G][BLOCKS];
  for (int g = 0; g < G; ++g) {
    for (int b = 0; b < BLOCKS; ++b) qb[g][b] = load16(q + (g * BLOCKS + b) * 16);
  }
  v16 partial[G][TILE];
  for (int64_t j = 0; j < TILE; ++j) {
    const T* k = keys[j];
    v16 key[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) key[b] = load16(k + 16 * b);
    for (int g = 0; g < G; ++g) {
      v16 lanes = qb[g][0] * key[0];
      keep_rounded(lanes);
      for (int b = 1; b < BLOCKS; ++b) lanes = mul_add(qb[g][b], key[b], lanes);
      partial[g][j] = lanes;
    }
  }
  for (int g = 0; g < G; ++g) store_scores(partial[g], scaling, keys.count, w + g * seen + keys.c0);
}

// score_tile_heads for one head of any size (a multiple of 16): the same sums, the tile's sixteen key pointers live.
template <typename T>
__attribute__((always_inline)) inline void score_tile(const float* q, const TileKeys<T>& keys, float scaling,
                                                      float* w) {
  const T* k[TILE];
  for (int64_t j = 0; j < TILE; ++j) k[j] = keys[j];
  v16 partial[TILE];
  const v16 q0 = load16(q);
  for (int64_t j = 0; j < TILE; ++j) partial[j] = q0 * load16(k[j]);
  for (int64_t d = 16; d < keys.dim; d += 16) {
    const v16 qd = load16(q + d);
    for (int64_t j = 0; j < TILE; ++j) partial[j] = mul_add(qd, load16(k[j] + d), partial[j]);
  }
  store_scores(partial, scaling, keys.count, w + keys.c0);
}

// A row's scores for its G heads (q at the first of them) against the tile `keys`: heads of 64 dimensions all at once,
// of 128 two at a time (the queries held in registers: 16 vectors at most), others one by one.
template <int G, typename T>
__attribute__((always_inline)) inline void score_heads(const float* q, const TileKeys<T>& keys, float scaling, float* w,
                                                       int64_t seen) {
  if (keys.dim == 64) return score_tile_heads<G, 4>(q, keys, scaling, w, seen);
  if (keys.dim == 128) {
    int g = 0;
    for (; g + 2 <= G; g += 2) score_tile_heads<2, 8>(q + g * 128, keys, scaling, w + g * seen, seen);
    if (g < G) score_tile_heads<1, 8>(q + g * 128, keys, scaling, w + g * seen, seen);
    return;
  }
  for (int g = 0; g < G; ++g) score_tile(q + g * keys.dim, keys, scaling, w + g * seen);
}

// The outputs of R rows for their G heads in B blocks of 16 dimensions (vp and out at the first of them; out's row r at
// rows[r].row): the values of the columns each row sees, in column order, weighted by its softmax numerators, then
// divided by their sums (`inverse`, [R][G]).  The rows see the same cached columns (one row, or a draft's rows): each
// cached value is read once for all of them while the R x G x B sums stay in registers, then each row goes on over its
// own new columns.  A row's sums are added column by column in order whatever R is, so its output does not depend on
// the rows it is summed with; reading the values once for a draft's rows made 12 rows' attention 7% faster
// (docs/results/attention-rows-shared-xeon-smollm2-135m).
template <int G, int R, int B, typename T>
void sum_values(const QueryRow* rows, const float* inverse, const T* vp, int64_t dim, T* out, int64_t heads) {
  const int64_t cached = rows[0].columns.cached, first_cached = rows[0].columns.first_cached;
  v16 sum[R][G][B];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      for (int b = 0; b < B; ++b) sum[r][g][b] = v16{};
    }
  }
  for (int64_t c = 0; c < cached; ++c) {
    if (c + PREFETCH_KEYS < cached) prefetch_row(vp + (first_cached + c + PREFETCH_KEYS) * dim, B * 16);
    const T* v = vp + (first_cached + c) * dim;
    v16 value[B];
    for (int b = 0; b < B; ++b) value[b] = load16(v + b * 16);
    for (int r = 0; r < R; ++r) {
      const float* weights = rows[r].weights.data() + c;
      const int64_t seen = rows[r].columns.count();
      for (int g = 0; g < G; ++g) {
        for (int b = 0; b < B; ++b) sum[r][g][b] = mul_add(weights[g * seen], value[b], sum[r][g][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const Columns& columns = rows[r].columns;
    const float* weights = rows[r].weights.data();
    const int64_t seen = columns.count();
    for (int64_t c = cached; c < seen; ++c) {
      const T* v = vp + columns[c] * dim;
      for (int b = 0; b < B; ++b) {
        const v16 value = load16(v + b * 16);
        for (int g = 0; g < G; ++g) sum[r][g][b] = mul_add(weights[g * seen + c], value, sum[r][g][b]);
      }
    }
    T* o = out + rows[r].row * heads * dim;
    for (int g = 0; g < G; ++g) {
      for (int b = 0; b < B; ++b) {
        const v16 result = sum[r][g][b] * inverse[r * G + g];
        for (int l = 0; l < 16; ++l) o[g * dim + b * 16 + l] = static_cast<T>(result[l]);
      }
    }
  }
}

#if defined(__AVX512F__)
constexpr int SUM_VECTORS = 24;  // of the 32 registers
#else
constexpr int SUM_VECTORS = 6;  // 12 of the 16 registers (two a 16-float value)
#endif

// sum_values over every block of a head's dimensions, as many blocks at once as keep the R x G x B sums within
// SUM_VECTORS.
template <int G, int R, typename T>
void sum_values_all(const QueryRow* rows, const float* inverse, const T* vp, int64_t dim, T* out, int64_t heads) {
  constexpr int B = R * G * 4 <= SUM_VECTORS ? 4 : R * G * 2 <= SUM_VECTORS ? 2 : 1;
  int64_t first = 0;
  for (; first + 16 * B <= dim; first += 16 * B) {
    sum_values<G, R, B>(rows, inverse, vp + first, dim, out + first, heads);
  }
  for (; first < dim; first += 16) sum_values<G, R, 1>(rows, inverse, vp + first, dim, out + first, heads);
}

// The output of `rows` (one key head's G query heads each) over their columns: the scores of every row, tile by tile
// so that each tile's keys are read from memory once for all of them; then each row's softmax and its values.
template <int G, typename T>
void attend_rows(std::vector<QueryRow>& rows, int64_t g0, const T* kp, const T* vp, int64_t dim, float scaling,
                 T* out, int64_t heads) {
  int64_t longest = 0;
  for (QueryRow& r : rows) {
    r.weights.resize(G * r.columns.count());  // [head][column]
    longest = std::max(longest, r.columns.count());
  }
  for (int64_t c0 = 0; c0 < longest; c0 += TILE) {
    if (c0 + TILE < longest) {
      const Columns& widest = rows.back().columns;  // the item's last row sees the most columns of a chain
      for (int64_t j = c0 + TILE; j < std::min(c0 + 2 * TILE, widest.count()); ++j) {
        prefetch_row(kp + widest[j] * dim, dim);
      }
    }
    for (QueryRow& r : rows) {
      if (c0 >= r.columns.count()) continue;
      score_heads<G>(r.q.data() + g0 * dim, TileKeys<T>(kp, r.columns, c0, dim), scaling, r.weights.data(),
                     r.columns.count());
    }
  }
  const int64_t count = static_cast<int64_t>(rows.size());
  float inverse[ROWS_PER_ITEM * G];  // an item has at most ROWS_PER_ITEM rows
  bool same_cached = true;
  for (int64_t r = 0; r < count; ++r) {
    const Columns& columns = rows[r].columns;
    for (int g = 0; g < G; ++g) {
      inverse[r * G + g] = 1.f / softmax_numerators(rows[r].weights.data() + g * columns.count(), columns.count());
    }
    same_cached = same_cached && columns.cached == rows[0].columns.cached &&
                  columns.first_cached == rows[0].columns.first_cached;  // a sliding window may cut rows apart
  }
  out += g0 * dim;
  if (same_cached && count == 4) return sum_values_all<G, 4>(rows.data(), inverse, vp, dim, out, heads);
  if (same_cached && count == 3) return sum_values_all<G, 3>(rows.data(), inverse, vp, dim, out, heads);
  if (same_cached && count == 2) return sum_values_all<G, 2>(rows.data(), inverse, vp, dim, out, heads);
  for (int64_t r = 0; r < count; ++r) sum_values_all<G, 1>(&rows[r], &inverse[r * G], vp, dim, out, heads);
}

// One work item: `rows` rows of sequence `sequence` from its row `first`, against key head `kv_head` (its query heads
// all together), and what it costs: rows x the columns they see, about.
struct Item {
  int64_t sequence, first, rows, kv_head, cost;
};

// The work of a call, as each thread's range of items.  A sequence's rows are cut into blocks of equal size (at most
// ROWS_PER_ITEM rows), each block x key head an item, a key head's blocks next to each other (its keys and values stay
// in the thread's cache between them); the items are then split into one contiguous range a thread, of about equal
// cost: blocks of ROWS_PER_ITEM and a remainder, split by their count, would leave one thread twice the other's rows
// on a tree of 9 or 10 rows (docs/results/attention-split-xeon-smollm2-135m).  How the work is split changes no row's
// arithmetic: each (row, head) is computed by the same loop wherever it runs.
std::vector<Item> items_of(const int64_t* meta, int64_t sequences, int64_t kv_heads) {
  std::vector<Item> items;
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t n = meta[s * 5 + 2], columns = meta[s * 5 + 3] + n;
    const int64_t blocks = (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * n / blocks, rows = (b + 1) * n / blocks - first;
        items.push_back({s, first, rows, h, rows * columns});
      }
    }
  }
  return items;
}

// The first item of each of `threads` ranges of about equal cost, and the end: [threads + 1] boundaries.
std::vector<int64_t> split_by_cost(const std::vector<Item>& items, int64_t threads) {
  int64_t total = 0;
  for (const Item& item : items) total += item.cost;
  std::vector<int64_t> bounds(threads + 1, static_cast<int64_t>(items.size()));
  bounds[0] = 0;
  int64_t done = 0, t = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()) && t < threads; ++i) {
    // Item i ends range t - 1 where the work before it is nearer range t's share than the work after it.
    const int64_t share = total * t / threads;
    if (done + items[i].cost / 2 >= share) bounds[t++] = i;
    done += items[i].cost;
  }
  return bounds;  // ranges not begun by then are empty: they start at the end
}

// meta: [sequences, 5] int64: slot, first row, rows, cached length, offset of the rows x rows tree mask in `masks`
// (-1: a chain, causal).  query [heads, rows, dim] (any strides, last dim contiguous); keys/values the layer's
// storage [slots, kv_heads, capacity, dim] (contiguous), the new tokens' already written at the cached length;
// positions [rows] of the new tokens (a sliding window compares them); out [rows, heads, dim].
template <typename T>
void attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& meta,
            const at::Tensor& masks, const at::Tensor& positions, double scale, int64_t window, at::Tensor& out) {
  const int64_t heads = query.size(0), dim = query.size(2);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2);
  const int64_t groups = heads / kv_heads;
  const int64_t q_head = query.stride(0), q_row = query.stride(1);
  const T* q_data = query.data_ptr<T>();
  const T* k_data = keys.data_ptr<T>();
  const T* v_data = values.data_ptr<T>();
  const int64_t* m = meta.data_ptr<int64_t>();
  const bool* mask_data = masks.numel() ? masks.data_ptr<bool>() : nullptr;
  const int64_t* pos = positions.data_ptr<int64_t>();
  T* o_data = out.data_ptr<T>();
  // An item attends its query heads that share a key head together, so that each key and value is read once for all
  // of them (the slots' keys and values outgrow the caches, and reading them is most of the work).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const std::vector<Item> items = items_of(m, meta.size(0), kv_heads);
  const std::vector<int64_t> bounds = split_by_cost(items, threads);
  const float scaling = static_cast<float>(scale);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<QueryRow> rows;
    for (int64_t index = bounds[begin]; index < bounds[end]; ++index) {  // threads' ranges are contiguous
      const Item& item = items[index];
      const int64_t s = item.sequence, i0 = item.first, count = item.rows, kvh = item.kv_head;
      const int64_t slot = m[s * 5], first = m[s * 5 + 1], n = m[s * 5 + 2], past = m[s * 5 + 3];
      const int64_t mask_offset = m[s * 5 + 4];
      rows.resize(count);
      for (int64_t r = 0; r < count; ++r) {
        const int64_t i = i0 + r;
        QueryRow& row = rows[r];
        row.row = first + i;
        row.q.resize(groups * dim);
        for (int64_t g = 0; g < groups; ++g) {
          const T* qp = q_data + (kvh * groups + g) * q_head + row.row * q_row;
          for (int64_t d = 0; d < dim; ++d) row.q[g * dim + d] = static_cast<float>(qp[d]);
        }
        // The columns this row sees, in column order: the cache (cut by a sliding window), then the new tokens' it
        // may see (its own causal prefix, or its tree ancestors and itself).
        const int64_t oldest = window > 0 ? pos[row.row] - window : -1;  // keys at positions <= oldest are cut
        const int64_t first_cached = window > 0 ? std::min(past, std::max<int64_t>(0, oldest + 1)) : 0;
        row.columns.first_cached = first_cached;
        row.columns.cached = past - first_cached;
        row.columns.news.clear();
        for (int64_t j = 0; j < n; ++j) {
          const bool allowed = mask_offset < 0 ? j <= i : mask_data[mask_offset + i * n + j];
          if (allowed && pos[first + j] > oldest) row.columns.news.push_back(past + j);
        }
      }
      const T* kp = k_data + (slot * kv_heads + kvh) * capacity * dim;
      const T* vp = v_data + (slot * kv_heads + kvh) * capacity * dim;
      T* op = o_data + kvh * groups * dim;
      for (int64_t g = 0; g < groups; g += 4) {  // the key head's query heads, four at a time
        switch (std::min<int64_t>(4, groups - g)) {
          case 4: attend_rows<4>(rows, g, kp, vp, dim, scaling, op, heads); break;
          case 3: attend_rows<3>(rows, g, kp, vp, dim, scaling, op, heads); break;
          case 2: attend_rows<2>(rows, g, kp, vp, dim, scaling, op, heads); break;
          default: attend_rows<1>(rows, g, kp, vp, dim, scaling, op, heads); break;
        }
      }
    }
  });
}

at::Tensor ragged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& meta, const at::Tensor& masks, const at::Tensor& positions, double scale,
                            int64_t window, at::Tensor out) {
  TORCH_CHECK(query.size(2) % 16 == 0, "head size must be a multiple of 16");
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "unexpected shapes");
  TORCH_CHECK(query.stride(2) == 1 && keys.is_contiguous() && values.is_contiguous(), "unexpected layout");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && out.scalar_type() == keys.scalar_type(), "mixed dtypes");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.is_contiguous() && positions.is_contiguous(), "bad metadata");
  TORCH_CHECK(out.is_contiguous() && out.size(1) == query.size(0) && out.size(2) == query.size(2), "bad output");
  if (query.scalar_type() == at::kFloat) {
    attend<float>(query, keys, values, meta, masks, positions, scale, window, out);
  } else if (query.scalar_type() == at::kBFloat16) {
    attend<c10::BFloat16>(query, keys, values, meta, masks, positions, scale, window, out);
  } else {
    TORCH_CHECK(false, "ragged_attention takes float32 or bfloat16");
  }
  return out;
}

// Each sequence's new keys and values (new_keys/new_values [kv_heads, rows, dim], any strides, last dim contiguous)
// into its slot at its cached length: meta as above (slot, first row, rows, cached length, -).
void write_slots(at::Tensor keys, at::Tensor values, const at::Tensor& new_keys, const at::Tensor& new_values,
                 const at::Tensor& meta) {
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes(), "unexpected storage");
  TORCH_CHECK(new_keys.scalar_type() == keys.scalar_type() && new_values.scalar_type() == keys.scalar_type(),
              "mixed dtypes");
  TORCH_CHECK(new_keys.stride(2) == 1 && new_values.stride(2) == 1, "unexpected layout");
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2), dim = keys.size(3);
  const int64_t bytes = dim * keys.element_size();
  char* k_data = static_cast<char*>(keys.data_ptr());
  char* v_data = static_cast<char*>(values.data_ptr());
  const char* nk = static_cast<const char*>(new_keys.data_ptr());
  const char* nv = static_cast<const char*>(new_values.data_ptr());
  const int64_t size = keys.element_size();
  const int64_t* m = meta.data_ptr<int64_t>();
  for (int64_t s = 0; s < meta.size(0); ++s) {
    const int64_t slot = m[s * 5], first = m[s * 5 + 1], n = m[s * 5 + 2], past = m[s * 5 + 3];
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t to = ((slot * kv_heads + h) * capacity + past + i) * bytes;
        std::memcpy(k_data + to, nk + (h * new_keys.stride(0) + (first + i) * new_keys.stride(1)) * size, bytes);
        std::memcpy(v_data + to, nv + (h * new_values.stride(0) + (first + i) * new_values.stride(1)) * size, bytes);
      }
    }
  }
}

// Columns `columns` (ascending, all >= start) of slot `slot` become columns start, start + 1, ... of every layer's
// keys and values (`storage`: each [slots, kv_heads, capacity, dim], contiguous): a tree's accepted path moved next to
// the cache, one call where indexing took two copies per layer.  Each target column is at or before its source and
// before every later source, so copying in order never overwrites a column still to be read.
void move_columns(const std::vector<at::Tensor>& storage, int64_t slot, int64_t start, const at::Tensor& columns) {
  TORCH_CHECK(columns.scalar_type() == at::kLong && columns.is_contiguous(), "columns must be int64");
  const int64_t* source = columns.data_ptr<int64_t>();
  const int64_t count = columns.numel();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(source[i] >= start + i && (i == 0 || source[i] > source[i - 1]), "columns must ascend from start");
  }
  for (const at::Tensor& tensor : storage) {
    TORCH_CHECK(tensor.dim() == 4 && tensor.is_contiguous(), "unexpected storage");
    const int64_t kv_heads = tensor.size(1), capacity = tensor.size(2);
    TORCH_CHECK(slot < tensor.size(0) && (count == 0 || source[count - 1] < capacity), "column out of range");
    const int64_t bytes = tensor.size(3) * tensor.element_size();
    char* data = static_cast<char*>(tensor.data_ptr());
    for (int64_t h = 0; h < kv_heads; ++h) {
      char* head = data + (slot * kv_heads + h) * capacity * bytes;
      for (int64_t i = 0; i < count; ++i) {
        if (source[i] != start + i) std::memmove(head + (start + i) * bytes, head + source[i] * bytes, bytes);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY(specdecode_attention, m) {
  m.def(
      "ragged_attention(Tensor query, Tensor keys, Tensor values, Tensor meta, Tensor masks, Tensor positions, "
      "float scale, int window, Tensor(a!) out) -> Tensor(a!)");
  m.impl("ragged_attention", c10::DispatchKey::CPU, TORCH_FN(ragged_attention));
  m.def("write_slots(Tensor(a!) keys, Tensor(b!) values, Tensor new_keys, Tensor new_values, Tensor meta) -> ()");
  m.impl("write_slots", c10::DispatchKey::CPU, TORCH_FN(write_slots));
  m.def("move_columns(Tensor(a!)[] storage, int slot, int start, Tensor columns) -> ()");
  m.impl("move_columns", c10::DispatchKey::CPU, TORCH_FN(move_columns));
}
