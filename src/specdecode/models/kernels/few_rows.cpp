// A product of a few fp32 rows by a dense fp32 weight, x [rows, in] times w [out, in] transposed, for the CPU fast
// path's one-to-three-row calls (specdecode/models/fastpath.py).
//
// A decoding step multiplies one row (or a short draft's few) by every weight of the model, so it is bound by reading
// the weights; oneDNN's prepacked product reads them at 40-50 GB/s for one row on a 2-core AVX-512 EPYC, this loop
// at 55-72 (docs/results/cpu-kernels-forward-cost-smollm2-135m).  Tiles of up to 4 rows by 4 output channels keep
// 16 running sums of 16 lanes in registers while each weight vector is read once for the tile's rows.  Each output is
// the sum over `in` of its row times its channel, in blocks of 16 lanes in order and then by sum16: what a row gets
// does not depend on the other rows of the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "vector16.h"

namespace {

using namespace specdecode;

// Rows [0, R) of x times channels [n, n + C) of w into out (row stride `channels`).
template <int R, int C>
inline void tile(const float* x, const float* w, int64_t in, int64_t channels, int64_t n, float* out) {
  v16 sums[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) sums[r][c] = v16{};
  }
  for (int64_t k = 0; k < in; k += 16) {
    v16 weights[C];
    for (int c = 0; c < C; ++c) weights[c] = load16(w + (n + c) * in + k);
    for (int r = 0; r < R; ++r) {
      const v16 row = load16(x + r * in + k);
      for (int c = 0; c < C; ++c) sums[r][c] += row * weights[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[r * channels + n + c] = sum16(sums[r][c]);
  }
}

// Every row of x times channels [n, n + C), four rows at a time (the tile's weights stay in the cache meanwhile).
template <int C>
void channel_block(const float* x, const float* w, int64_t rows, int64_t in, int64_t channels, int64_t n, float* out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile<4, C>(x + r * in, w, in, channels, n, out + r * channels);
  switch (rows - r) {
    case 3: tile<3, C>(x + r * in, w, in, channels, n, out + r * channels); break;
    case 2: tile<2, C>(x + r * in, w, in, channels, n, out + r * channels); break;
    case 1: tile<1, C>(x + r * in, w, in, channels, n, out + r * channels); break;
    default: break;
  }
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [rows, in] and w [out, in] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "few_rows_linear takes float32");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(x.size(1) % 16 == 0, "the inner size must be a multiple of 16");
  const int64_t rows = x.size(0), in = x.size(1), channels = w.size(0);
  TORCH_CHECK(out.size(0) == rows && out.size(1) == channels, "bad output");
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int64_t BLOCK = 32;  // output channels per unit of work
  at::parallel_for(0, (channels + BLOCK - 1) / BLOCK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * BLOCK, last = std::min(channels, first + BLOCK);
      int64_t n = first;
      for (; n + 4 <= last; n += 4) channel_block<4>(xp, wp, rows, in, channels, n, op);
      for (; n < last; ++n) channel_block<1>(xp, wp, rows, in, channels, n, op);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdecode_linear, m) {
  m.def("few_rows_linear(Tensor x, Tensor w, Tensor(a!) out) -> Tensor(a!)");
  m.impl("few_rows_linear", c10::DispatchKey::CPU, TORCH_FN(few_rows_linear));
}
