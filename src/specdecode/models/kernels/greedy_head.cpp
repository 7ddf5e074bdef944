// The greedy choice of each row of an fp32 LM head (the panel product's weight, panel_linear.cpp) without computing
// the whole row in fp32 (specdecode/models/greedy_head.py).
//
// A greedy decision reads one number of a row's vocabulary-sized logits: the index of its largest.  So the row is
// first computed in bf16 (AVX512_BF16's dot product: half the weight bytes of fp32 and twice the products per
// instruction), with a bound on how far each bf16 logit can be from the fp32 one; only the tokens whose bf16 logit
// plus its bound reaches the largest bf16 logit minus its bound can hold the fp32 maximum, and their panels are
// computed again by the panel product's own tile, which gives bitwise the fp32 logits the full product gives.  The
// largest of those, the first on a tie (as torch.argmax), is the row's choice: the choice of the full fp32 logits,
// not an approximation of it.
//
// The bound (x the row's input, w_i token i's weight row, n inputs, u = 2^-9 bf16's unit roundoff, g = n 2^-24 / (1
// - n 2^-24) fp32's error bound for an n-term sum): rounding x and w_i to bf16 moves each product by at most
// (2u + u^2) |x_k w_ik|; the bf16 dot product's fp32 sums add at most g (1 + u)^2 sum |x_k w_ik|, and the fp32
// multiply-add chain of the full product is itself within g sum |x_k w_ik| of the exact sum.  By Cauchy-Schwarz
// sum |x_k w_ik| <= |x| |w_i|, so |bf16 logit - fp32 logit| <= scale |x| |w_i| + floor, with scale (chosen by the
// caller) covering those terms and floor the products and inputs bf16 flushes to zero.  |x| and |w_i| are rounded
// up by the caller, and scale also covers this kernel's own fp32 sums of a logit and its bound.
//
// Where the CPU lacks AVX512_BF16 the caller never calls this (the fast path's full product runs instead).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <memory>

#include "bf16_panel_tile.h"
#include "panel_tile.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace {

using namespace specdecode;

// Row r's choice from its bf16 logits `approx` (channels of them): the tokens whose bound reaches the largest lower
// bound, each one's panel computed again in fp32 by the panel product's tile.
int64_t choose(const float* approx, const float* norms, float bound_scale, float floor, const float* x,
               const float* panels_fp32, int64_t in, int64_t channels) {
  vec lowest = vec{} - INFINITY;
  for (int64_t i = 0; i < channels; i += LANES) {
    const vec lower = load(approx + i) - (bound_scale * load(norms + i) + floor);
    lowest = lower > lowest ? lower : lowest;
  }
  float threshold = -INFINITY;
  for (int lane = 0; lane < LANES; ++lane) threshold = lowest[lane] > threshold ? lowest[lane] : threshold;
  int64_t best = -1, computed_panel = -1;
  float best_value = -INFINITY;
  alignas(64) float exact[16];
  for (int64_t start = 0; start < channels; start += LANES) {
    const vec upper = load(approx + start) + (bound_scale * load(norms + start) + floor);
    const veci reaches = upper >= threshold;
    bool any = false;
    for (int lane = 0; lane < LANES; ++lane) any |= reaches[lane] != 0;
    if (!any) continue;
    for (int lane = 0; lane < LANES; ++lane) {
      if (!reaches[lane]) continue;
      const int64_t i = start + lane, panel = i / 16;
      if (panel != computed_panel) {
        tile<1, 1, 0>(x, panels_fp32 + panel * in * 16, in, 16, 0, exact, NextPanels{});
        computed_panel = panel;
      }
      const float value = exact[i % 16];
      if (best < 0 || value > best_value) {
        best = i;
        best_value = value;
      }
    }
  }
  return best;
}

// x [rows, in] fp32 (finite), x_bf16 its bf16 rounding as pairs [rows, in / 2], panels_fp32 the head's panel weight
// [P, in, 16], panels_bf16 its bf16 rounding as pairs [P, in / 2, 16], norms [P * 16] (|w_i| rounded up),
// x_norms [rows] (|x| rounded up): each row's greedy choice into choices [rows].  `widened`: the bf16 screen by
// bf16_product's widened product (the same bits but for subnormal numbers, which it does not flush: within the bound).
at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& x_bf16, const at::Tensor& panels_fp32,
                       const at::Tensor& panels_bf16, const at::Tensor& norms, const at::Tensor& x_norms,
                       double bound_scale, double floor, bool widened, at::Tensor choices) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x [rows, in] float32 expected");
  const int64_t rows = x.size(0), in = x.size(1), half = in / 2, panels = panels_fp32.size(0), channels = panels * 16;
  TORCH_CHECK(in % 2 == 0 && x_bf16.scalar_type() == at::kInt && x_bf16.is_contiguous() && x_bf16.size(0) == rows &&
                  x_bf16.size(1) == half,
              "x_bf16 [rows, in / 2] int32 pairs expected");
  TORCH_CHECK(panels_fp32.dim() == 3 && panels_fp32.size(1) == in && panels_fp32.size(2) == 16 &&
                  panels_fp32.scalar_type() == at::kFloat && panels_fp32.is_contiguous(),
              "fp32 panels [P, in, 16] expected");
  TORCH_CHECK(panels_bf16.dim() == 3 && panels_bf16.size(0) == panels && panels_bf16.size(1) == half &&
                  panels_bf16.size(2) == 16 && panels_bf16.scalar_type() == at::kInt && panels_bf16.is_contiguous(),
              "bf16 panels [P, in / 2, 16] int32 pairs expected");
  TORCH_CHECK(norms.numel() == channels && norms.scalar_type() == at::kFloat && x_norms.numel() == rows &&
                  x_norms.scalar_type() == at::kFloat && choices.numel() == rows && choices.scalar_type() == at::kLong,
              "bad norms or choices");
  if (rows == 0) return choices;
  std::unique_ptr<float[]> approx(new float[rows * channels]);  // every entry written below
  const auto* xb = reinterpret_cast<const uint32_t*>(x_bf16.data_ptr<int32_t>());
  const auto* wb = reinterpret_cast<const uint32_t*>(panels_bf16.data_ptr<int32_t>());
  bf16_product(rows, xb, wb, half, panels, approx.get(), widened);
  const float* xp = x.data_ptr<float>();
  const float* wp = panels_fp32.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const float* xn = x_norms.data_ptr<float>();
  int64_t* cp = choices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      cp[r] = choose(approx.get() + r * channels, np, static_cast<float>(bound_scale * xn[r]),
                     static_cast<float>(floor), xp + r * in, wp, in, channels);
    }
  });
  return choices;
}

}  // namespace

TORCH_LIBRARY(specdecode_greedy_head, m) {
  m.def(
      "greedy_head(Tensor x, Tensor x_bf16, Tensor panels_fp32, Tensor panels_bf16, Tensor norms, Tensor x_norms, "
      "float bound_scale, float floor, bool widened, Tensor(a!) choices) -> Tensor(a!)");
  m.impl("greedy_head", c10::DispatchKey::CPU, TORCH_FN(greedy_head));
}

#endif  // __x86_64__
