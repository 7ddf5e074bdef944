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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vector16.h"

namespace {

using namespace specdecode;

// e^x for x <= 0 (a score minus the row's largest), lane by lane: libm's expf is a call per number, and on a decoding
// step it took most of the kernel's time.  x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6
// (relative error under 2e-7 there), times 2^n built in the exponent bits.  Every lane is computed alike, so a
// number's result does not depend on the lane it is in.
inline v16 exp16(v16 x) {
  const v16 floor_x = x < -87.0f ? v16{} - 87.0f : x;  // e^-87 is about float's smallest normal; below, 0 is as good
  // n = round(x / ln2): x <= 0, so -x / ln2 + 0.5 > 0, and truncating it rounds.
  const v16i n = -__builtin_convertvector(0.5f - floor_x * 1.44269504088896341f, v16i);
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = (floor_x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  v16 p = r * (1.f / 720.f) + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const v16i bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// w[0..count) = e^(w - max w), returning their sum: blocks of 16 (the last one padded), summed lane-wise in order and
// then by sum16, so the result depends on the numbers and their count only.
inline float softmax_numerators(float* w, int64_t count) {
  v16 top = v16{} - std::numeric_limits<float>::infinity();
  v16 block;
  for (int64_t c = 0; c < count; c += 16) {
    block = v16{} - std::numeric_limits<float>::infinity();
    std::memcpy(&block, w + c, sizeof(float) * std::min<int64_t>(16, count - c));
    top = top > block ? top : block;
  }
  float largest = top[0];
  for (int l = 1; l < 16; ++l) largest = std::max(largest, top[l]);
  v16 total{};
  for (int64_t c = 0; c < count; c += 16) {
    const int64_t lanes = std::min<int64_t>(16, count - c);
    block = v16{} + largest;  // padding lanes: e^0, left out of the sum below
    std::memcpy(&block, w + c, sizeof(float) * lanes);
    block = exp16(block - largest);
    for (int64_t l = lanes; l < 16; ++l) block[l] = 0.f;
    total += block;
    std::memcpy(w + c, &block, sizeof(float) * lanes);
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
  const std::vector<int64_t>& news;
  int64_t count() const { return cached + static_cast<int64_t>(news.size()); }
  int64_t operator[](int64_t c) const { return c < cached ? first_cached + c : news[c - cached]; }
};

// Attention of G query heads (q: G x dim floats) sharing one key head (keys kp, values vp: [capacity, dim]) over
// `columns`; head g's output goes to out + g * dim.  G is a template argument so that the heads' running sums stay in
// registers while each key and value is read once for all of them.
template <int G, typename T>
void attend_heads(const float* q, const T* kp, const T* vp, const Columns& columns, int64_t dim, float scaling,
                  std::vector<float>& weights, T* out) {
  const int64_t seen = columns.count();
  weights.resize(G * seen);  // [head][column]
  for (int64_t c = 0; c < seen; ++c) {
    if (c + PREFETCH_KEYS < seen) prefetch_row(kp + columns[c + PREFETCH_KEYS] * dim, dim);
    const T* k = kp + columns[c] * dim;
    v16 partial[G];
    for (int g = 0; g < G; ++g) partial[g] = load16(q + g * dim) * load16(k);
    for (int64_t d = 16; d < dim; d += 16) {
      const v16 key = load16(k + d);
      for (int g = 0; g < G; ++g) partial[g] += load16(q + g * dim + d) * key;
    }
    for (int g = 0; g < G; ++g) weights[g * seen + c] = sum16(partial[g]) * scaling;
  }
  float inverse[G];
  for (int g = 0; g < G; ++g) inverse[g] = 1.f / softmax_numerators(weights.data() + g * seen, seen);
  // The values: each key's row read once, in column order, for every head and up to 64 dimensions at a time (the
  // sums stay in registers); each sum still adds the columns in order, one after another.
  for (int64_t first = 0; first < dim; first += 64) {
    const int64_t blocks = std::min<int64_t>(4, (dim - first) / 16);
    v16 sum[G][4];
    for (int g = 0; g < G; ++g) {
      for (int b = 0; b < 4; ++b) sum[g][b] = v16{};
    }
    for (int64_t c = 0; c < seen; ++c) {
      if (c + PREFETCH_KEYS < seen) prefetch_row(vp + columns[c + PREFETCH_KEYS] * dim + first, blocks * 16);
      const T* v = vp + columns[c] * dim + first;
      for (int64_t b = 0; b < blocks; ++b) {
        const v16 value = load16(v + b * 16);
        for (int g = 0; g < G; ++g) sum[g][b] += weights[g * seen + c] * value;
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        const v16 result = sum[g][b] * inverse[g];
        for (int l = 0; l < 16; ++l) out[g * dim + first + b * 16 + l] = static_cast<T>(result[l]);
      }
    }
  }
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
  const int64_t sequences = meta.size(0);
  // Work items: (sequence, row, key head), numbered row-major over the flattened rows; an item attends the query
  // heads that share its key head together, so that each key and value is read once for all of them (the slots'
  // keys and values outgrow the caches, and reading them is most of the work).
  std::vector<int64_t> owner;  // the sequence of every flattened row this call attends
  std::vector<int64_t> rows;
  for (int64_t s = 0; s < sequences; ++s) {
    for (int64_t i = 0; i < m[s * 5 + 2]; ++i) {
      owner.push_back(s);
      rows.push_back(i);
    }
  }
  const int64_t items = static_cast<int64_t>(owner.size()) * kv_heads;
  const float scaling = static_cast<float>(scale);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * dim), weights;
    std::vector<int64_t> news;  // the new tokens' columns the row sees
    for (int64_t item = begin; item < end; ++item) {
      const int64_t flat = item / kv_heads, kvh = item % kv_heads;
      const int64_t s = owner[flat], i = rows[flat];
      const int64_t slot = m[s * 5], first = m[s * 5 + 1], n = m[s * 5 + 2], past = m[s * 5 + 3];
      const int64_t mask_offset = m[s * 5 + 4];
      const int64_t row = first + i;
      for (int64_t g = 0; g < groups; ++g) {
        const T* qp = q_data + (kvh * groups + g) * q_head + row * q_row;
        for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = static_cast<float>(qp[d]);
      }
      // The columns this row sees, in column order: the cache (cut by a sliding window), then the new tokens' it
      // may see (its own causal prefix, or its tree ancestors and itself).
      const int64_t oldest = window > 0 ? pos[row] - window : -1;  // keys at positions <= oldest are cut
      const int64_t first_cached = window > 0 ? std::min(past, std::max<int64_t>(0, oldest + 1)) : 0;
      news.clear();
      for (int64_t j = 0; j < n; ++j) {
        const bool allowed = mask_offset < 0 ? j <= i : mask_data[mask_offset + i * n + j];
        if (allowed && pos[first + j] > oldest) news.push_back(past + j);
      }
      const Columns columns{first_cached, past - first_cached, news};
      const T* kp = k_data + (slot * kv_heads + kvh) * capacity * dim;
      const T* vp = v_data + (slot * kv_heads + kvh) * capacity * dim;
      T* op = o_data + (row * heads + kvh * groups) * dim;
      for (int64_t g = 0; g < groups; g += 4) {  // the key head's query heads, four at a time
        const float* qg = q.data() + g * dim;
        switch (std::min<int64_t>(4, groups - g)) {
          case 4: attend_heads<4>(qg, kp, vp, columns, dim, scaling, weights, op + g * dim); break;
          case 3: attend_heads<3>(qg, kp, vp, columns, dim, scaling, weights, op + g * dim); break;
          case 2: attend_heads<2>(qg, kp, vp, columns, dim, scaling, weights, op + g * dim); break;
          default: attend_heads<1>(qg, kp, vp, columns, dim, scaling, weights, op + g * dim); break;
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

}  // namespace

TORCH_LIBRARY(specdecode_attention, m) {
  m.def(
      "ragged_attention(Tensor query, Tensor keys, Tensor values, Tensor meta, Tensor masks, Tensor positions, "
      "float scale, int window, Tensor(a!) out) -> Tensor(a!)");
  m.impl("ragged_attention", c10::DispatchKey::CPU, TORCH_FN(ragged_attention));
  m.def("write_slots(Tensor(a!) keys, Tensor(b!) values, Tensor new_keys, Tensor new_values, Tensor meta) -> ()");
  m.impl("write_slots", c10::DispatchKey::CPU, TORCH_FN(write_slots));
}
