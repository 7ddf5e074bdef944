// Attention of one prompt chunk's rows (causal: token t of the chunk sees the cache and the chunk's tokens up to t) to
// its sequence's cache slot, fp32 (specdecode/models/attention_kernel.py says where it is used).
//
// Why not torch's SDPA: a chunk of 128 tokens at a few hundred cached positions is a small product per head (its
// inner size is the head's 64), where SDPA's blocked kernel ran at about a third of the vector units' peak on a 2-core
// EPYC, and attention took a fifth of reading a prompt (docs/results/chunk-attention-smollm2-135m).  Here the scores
// are the panel product of panel_tile.h (the keys packed once per call as panels of 16 columns), the weights times the
// values a tile of rows by whole value rows, both near the peak.
//
// Per key head, blocks of the chunk's tokens: the block's rows (token by token, the key head's query heads in order)
// get their scores against every column the block's last token sees, each row's softmax over the columns it sees
// (the rest set to exact zeros), then the weights times the values.  Numerics: a score is one multiply-add chain over
// the head's dimensions, a row's softmax sums its columns in a fixed order, and an output one multiply-add chain over
// the columns in order, where the columns a row does not see add exact zeros: a row's result depends on its query and
// the keys and values it sees only, not on the chunk's size or the block.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "panel_tile.h"

namespace {

using namespace specdecode;

// Row w: its first `seen` scores (times `scaling`) become e^(score - largest), the columns after it up to `width` exact
// zeros; returns 1 / their sum.  `width` is a whole number of vectors.
inline float softmax_row(float* w, int64_t seen, int64_t width, float scaling) {
  // The largest score (a positive scaling keeps the order, and rounding keeps it too: the largest scaled is the
  // largest times the scaling).
  const vec lowest = vec{} - std::numeric_limits<float>::infinity();
  vec top = lowest;
  int64_t c = 0;
  for (; c + LANES <= seen; c += LANES) {
    const vec block = load(w + c);
    top = top > block ? top : block;
  }
  float largest = top[0];
  for (int l = 1; l < LANES; ++l) largest = std::max(largest, top[l]);
  for (; c < seen; ++c) largest = std::max(largest, w[c]);
  largest *= scaling;
  vec total{};
  c = 0;
  for (; c + LANES <= seen; c += LANES) {
    const vec e = exp_vec(load(w + c) * scaling - largest);
    total += e;
    store(w + c, e);
  }
  if (c < seen) {  // the last part-vector: its unseen lanes become zeros
    vec block = load(w + c) * scaling - largest;
    vec e = exp_vec(block);
    for (int64_t l = seen - c; l < LANES; ++l) e[l] = 0.f;
    total += e;
    store(w + c, e);
    c += LANES;
  }
  for (; c < width; c += LANES) store(w + c, vec{});
  float sum = 0.f;
  for (int l = 0; l < LANES; ++l) sum += total[l];
  return 1.f / sum;
}

#if defined(__AVX512F__)
constexpr int VALUE_ROWS = 6;  // 6 rows x 4 vectors of a value row: 24 of the 32 registers hold sums
#else
constexpr int VALUE_ROWS = 3;  // 3 rows x 4 vectors: 12 of the 16
#endif
constexpr int VALUE_PARTS = 4;  // vectors of a value row per pass

// Rows [0, R) of the weights w (row stride `width`) times values v ([columns, dim]) over columns [0, columns), for
// dimensions [first, first + VALUE_PARTS * LANES), each row scaled by its inverse sum, into out (row r at out_rows[r]).
template <int R>
inline void value_tile(const float* w, int64_t width, const float* v, int64_t dim, int64_t columns, int64_t first,
                       const float* inverse, float* const* out_rows) {
  vec sums[R][VALUE_PARTS];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < VALUE_PARTS; ++p) sums[r][p] = vec{};
  }
  for (int64_t c = 0; c < columns; ++c) {
    vec value[VALUE_PARTS];
    for (int p = 0; p < VALUE_PARTS; ++p) value[p] = load(v + c * dim + first + p * LANES);
    for (int r = 0; r < R; ++r) {
      const vec weight = broadcast(w[r * width + c]);
      for (int p = 0; p < VALUE_PARTS; ++p) sums[r][p] += weight * value[p];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < VALUE_PARTS; ++p) store(out_rows[r] + first + p * LANES, sums[r][p] * inverse[r]);
  }
}

template <int R>
inline void value_rows(const float* w, int64_t width, const float* v, int64_t dim, int64_t columns,
                       const float* inverse, float* const* out_rows) {
  for (int64_t first = 0; first < dim; first += VALUE_PARTS * LANES) {
    value_tile<R>(w, width, v, dim, columns, first, inverse, out_rows);
  }
}

// query [heads, n, dim] (last dim contiguous); keys/values the layer's storage [slots, kv_heads, capacity, dim], the
// chunk's already written at [past, past + n) of `slot`; out [n, heads, dim].
at::Tensor chunk_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, int64_t slot,
                           int64_t past, double scale, at::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "unexpected shapes");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "chunk_attention takes float32");
  TORCH_CHECK(query.stride(2) == 1 && keys.is_contiguous() && values.is_contiguous() && out.is_contiguous(),
              "unexpected layout");
  const int64_t heads = query.size(0), n = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2), groups = heads / kv_heads;
  TORCH_CHECK(dim % (VALUE_PARTS * LANES) == 0 && dim % 16 == 0, "head size must be a multiple of 64");
  TORCH_CHECK(past + n <= capacity && out.size(0) == n && out.size(1) == heads && out.size(2) == dim, "bad sizes");
  const int64_t seen_all = past + n, panels = (seen_all + 15) / 16, width = panels * 16;
  const float* q_data = query.data_ptr<float>();
  const float* k_data = keys.data_ptr<float>() + slot * kv_heads * capacity * dim;
  const float* v_data = values.data_ptr<float>() + slot * kv_heads * capacity * dim;
  float* o_data = out.data_ptr<float>();
  const float scaling = static_cast<float>(scale);

  // The keys as panels [kv_heads][panels][dim][16], columns past the chunk zero.
  std::vector<float> packed(kv_heads * width * dim);
  at::parallel_for(0, kv_heads * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / panels, panel = item % panels;
      float* to = packed.data() + (h * panels + panel) * dim * 16;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t column = panel * 16 + j;
        const float* key = k_data + (h * capacity + column) * dim;
        for (int64_t d = 0; d < dim; ++d) to[d * 16 + j] = column < seen_all ? key[d] : 0.f;
      }
    }
  });

  // Blocks of about 48 rows: their scores (48 x a few thousand columns) stay in the core's cache.
  const int64_t block_tokens = std::max<int64_t>(1, 48 / groups);
  const int64_t blocks = (n + block_tokens - 1) / block_tokens;
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(block_tokens * groups * dim), scores, inverse(block_tokens * groups);
    std::vector<float*> out_rows(block_tokens * groups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, first_token = (item % blocks) * block_tokens;
      const int64_t tokens = std::min(block_tokens, n - first_token), rows = tokens * groups;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t row = t * groups + g, head = h * groups + g;
          std::memcpy(q.data() + row * dim, q_data + head * query.stride(0) + (first_token + t) * query.stride(1),
                      dim * sizeof(float));
          out_rows[row] = o_data + ((first_token + t) * heads + head) * dim;
        }
      }
      const int64_t block_seen = past + first_token + tokens, block_panels = (block_seen + 15) / 16;
      const int64_t block_width = block_panels * 16;
      scores.resize(rows * block_width);
      const float* key_panels = packed.data() + h * panels * dim * 16;
      const int64_t pairs = (block_panels + 1) / 2;
      panel_pairs(rows, q.data(), key_panels, dim, block_width, block_panels, 0, pairs, scores.data());
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t seen = past + first_token + row / groups + 1;
        inverse[row] = softmax_row(scores.data() + row * block_width, seen, block_width, scaling);
      }
      const float* vp = v_data + h * capacity * dim;
      for (int64_t row = 0; row < rows; row += VALUE_ROWS) {
        const int64_t count = std::min<int64_t>(VALUE_ROWS, rows - row);
        const int64_t columns = past + first_token + (row + count - 1) / groups + 1;  // what its last row sees
        const float* w = scores.data() + row * block_width;
        switch (count) {
          case 1: value_rows<1>(w, block_width, vp, dim, columns, inverse.data() + row, out_rows.data() + row); break;
          case 2: value_rows<2>(w, block_width, vp, dim, columns, inverse.data() + row, out_rows.data() + row); break;
          case 3: value_rows<3>(w, block_width, vp, dim, columns, inverse.data() + row, out_rows.data() + row); break;
#if defined(__AVX512F__)
          case 4: value_rows<4>(w, block_width, vp, dim, columns, inverse.data() + row, out_rows.data() + row); break;
          case 5: value_rows<5>(w, block_width, vp, dim, columns, inverse.data() + row, out_rows.data() + row); break;
          case 6: value_rows<6>(w, block_width, vp, dim, columns, inverse.data() + row, out_rows.data() + row); break;
#endif
          default: break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdecode_chunk, m) {
  m.def(
      "chunk_attention(Tensor query, Tensor keys, Tensor values, int slot, int past, float scale, Tensor(a!) out) -> "
      "Tensor(a!)");
  m.impl("chunk_attention", c10::DispatchKey::CPU, TORCH_FN(chunk_attention));
}
