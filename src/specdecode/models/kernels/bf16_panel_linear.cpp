// The bf16 linear layers' product on CPUs with AVX512_BF16 (specdecode/models/quantized_layers.py, Bf16Linear): bf16
// rows times a bf16 weight packed once as panels of 16 output channels, fp32 out, by bf16_panel_tile.h's tile (by
// vdpbf16ps, or `widened`: the rows widened to fp32 once, the pairs by multiply-adds; the same bits).  A row
// gets the same bits alone as in any batch (each output one chain of pair products in input order), so verification
// rows need no calls cut to the sizes plain decoding makes, and a prompt's chunk of many rows runs the same kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "bf16_panel_tile.h"

#if defined(__x86_64__)

namespace {

using namespace specdecode;

// x_pairs [rows, in / 2] int32 (a row's bf16 inputs two to a word), panels [P, in / 2, 16] int32 pairs; out [rows,
// P * 16] fp32.
at::Tensor bf16_panel_linear(const at::Tensor& x_pairs, const at::Tensor& panels, at::Tensor out, bool widened) {
  TORCH_CHECK(x_pairs.dim() == 2 && x_pairs.scalar_type() == at::kInt && x_pairs.is_contiguous(),
              "x [rows, in / 2] int32 pairs expected");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.size(1) == x_pairs.size(1) &&
                  panels.scalar_type() == at::kInt && panels.is_contiguous(),
              "panels [P, in / 2, 16] int32 pairs expected");
  const int64_t rows = x_pairs.size(0), half = x_pairs.size(1), count = panels.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == count * 16 && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(),
              "bad output");
  if (rows == 0) return out;
  const auto* x = reinterpret_cast<const uint32_t*>(x_pairs.data_ptr<int32_t>());
  const auto* w = reinterpret_cast<const uint32_t*>(panels.data_ptr<int32_t>());
  float* o = out.data_ptr<float>();
  bf16_product(rows, x, w, half, count, o, widened);
  return out;
}

}  // namespace

TORCH_LIBRARY(specdecode_bf16, m) {
  m.def("bf16_panel_linear(Tensor x_pairs, Tensor panels, Tensor(a!) out, bool widened) -> Tensor(a!)");
  m.impl("bf16_panel_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_panel_linear));
}

#endif  // __x86_64__
