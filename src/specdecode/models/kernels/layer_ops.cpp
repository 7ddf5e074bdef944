// The elementwise steps of a Llama-shaped decoder layer, computed in fp32, one call each for every row of a forward
// (specdecode/models/layer_forward.py says where they are used).
//
// Why: around its products and its attention, a layer of transformers' modules makes some forty small torch calls
// (the norm alone six, the rotary embedding a dozen), each a few microseconds however few its rows.  These kernels do
// the norm, the rotary embedding and the gated activation in one pass each: a one-token forward of a 135M model on a
// 2-core EPYC went from 17.9 to 16.0 ms with them and the written-out layer (docs/results/layer-ops-smollm2-135m).
//
// Numerics: every row is computed on its own by one fixed sequence of operations (the norm's sum of squares in fixed
// lanes, then across them in a fixed order), so a row gets the same bits alone as in any batch, at any thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace {

using namespace specdecode;

// Rows of work per thread below which a call stays on one thread: waking the other costs more than a few rows.
constexpr int64_t ROWS_PER_THREAD = 8;

// The elements of a float32 or bfloat16 tensor, as the vector functions of vec.h take them.
template <typename T>
auto* elements(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
  }
}

template <typename Out>
void rms_norm_rows_as(const at::Tensor& x, const at::Tensor& weight, float epsilon, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  auto* op = elements<Out>(out);
  at::parallel_for(0, rows, ROWS_PER_THREAD, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * width;
      vec squares{};
      for (int64_t c = 0; c < width; c += LANES) {
        const vec v = load(row + c);
        squares += v * v;
      }
      float sum = 0.f;
      for (int l = 0; l < LANES; ++l) sum += squares[l];
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(width) + epsilon);
      for (int64_t c = 0; c < width; c += LANES) store(op + r * width + c, load(wp + c) * (load(row + c) * scale));
    }
  });
}

// out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for every row of x [rows, width] (width a whole number of
// vectors), computed in fp32; out float32, or bfloat16 for products that read bf16 rows (each number rounded as torch
// rounds the fp32 result: the same bits as converting it after an fp32 call, one pass fewer over the rows).
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm_rows reads float32");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out is float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "bad layout");
  TORCH_CHECK(x.size(1) % LANES == 0 && weight.numel() == x.size(1) && out.sizes() == x.sizes(), "bad sizes");
  const float epsilon = static_cast<float>(eps);
  if (out.scalar_type() == at::kFloat) {
    rms_norm_rows_as<float>(x, weight, epsilon, out);
  } else {
    rms_norm_rows_as<at::BFloat16>(x, weight, epsilon, out);
  }
}

template <typename In>
void rotate_rows_as(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim, at::Tensor& out) {
  const int64_t rows = x.size(0), heads = x.size(1) / dim, half = dim / 2;
  const auto* xp = elements<In>(x);
  float* op = out.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, rows, ROWS_PER_THREAD, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * dim;
      const float* s = sp + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const auto* head = xp + (r * heads + h) * dim;
        float* rotated = op + (r * heads + h) * dim;
        for (int64_t i = 0; i < half; i += LANES) {
          const vec first = load(head + i), second = load(head + half + i);
          store(rotated + i, first * load(c + i) - second * load(s + i));
          store(rotated + half + i, second * load(c + half + i) + first * load(s + half + i));
        }
      }
    }
  });
}

// The rotary embedding of every head of every row of x [rows, heads * dim] into out (float32, x's shape; x itself
// where x is float32): with h = dim / 2, x[i] becomes x[i] cos[i] - x[i + h] sin[i] and x[i + h] becomes
// x[i + h] cos[i + h] + x[i] sin[i + h] (transformers' q * cos + rotate_half(q) * sin); cos and sin [rows, dim].  x
// float32, or bfloat16 as a quantized layer's product gives it (a bf16 number is exact in fp32: the same bits as
// converting it first, one pass fewer).
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotate_rows reads float32 or bf16");
  TORCH_CHECK(out.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotate_rows writes float32");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "bad layout");
  const int64_t rows = x.size(0), heads = x.size(1) / dim, half = dim / 2;
  TORCH_CHECK(heads * dim == x.size(1) && half % LANES == 0 && out.sizes() == x.sizes(), "bad head size");
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "bad sizes");
  if (x.scalar_type() == at::kFloat) {
    rotate_rows_as<float>(x, cos, sin, dim, out);
  } else {
    rotate_rows_as<at::BFloat16>(x, cos, sin, dim, out);
  }
}

template <typename In, typename Out>
void silu_mul_as(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), width = gate.size(1);
  const auto* gp = elements<In>(gate);
  const auto* up_data = elements<In>(up);
  auto* op = elements<Out>(out);
  at::parallel_for(0, rows, ROWS_PER_THREAD, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * width; i < end * width; i += LANES) {
      const vec g = load(gp + i);
      store(op + i, g / (1.f + exp_vec(vec{} - g)) * load(up_data + i));
    }
  });
}

// out = silu(gate) * up = gate / (1 + e^-gate) * up, elementwise, for gate and up [rows, width], computed in fp32.
// gate and up are float32 or bfloat16 (both the same), out either: a quantized layer's products come out in bf16 and
// its next product takes bf16, so the activation reads and writes them as they are, each number as the conversions
// to and from fp32 around an fp32 call would give it (a bf16 number is exact in fp32; the result rounded as torch
// rounds it).
void silu_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor out) {
  const auto in = gate.scalar_type();
  TORCH_CHECK(in == at::kFloat || in == at::kBFloat16, "silu_mul takes float32 or bfloat16");
  TORCH_CHECK(up.scalar_type() == in, "gate and up must have one dtype");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out is float32 or bfloat16");
  TORCH_CHECK(gate.is_contiguous() && up.is_contiguous() && out.is_contiguous(), "bad layout");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.sizes() == out.sizes(), "bad sizes");
  TORCH_CHECK(gate.size(1) % LANES == 0, "width must be a whole number of vectors");
  const bool out_float = out.scalar_type() == at::kFloat;
  if (in == at::kFloat) {
    out_float ? silu_mul_as<float, float>(gate, up, out) : silu_mul_as<float, at::BFloat16>(gate, up, out);
  } else {
    out_float ? silu_mul_as<at::BFloat16, float>(gate, up, out) : silu_mul_as<at::BFloat16, at::BFloat16>(gate, up, out);
  }
}

}  // namespace

TORCH_LIBRARY(specdecode_layer, m) {
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.impl("rms_norm_rows", c10::DispatchKey::CPU, TORCH_FN(rms_norm_rows));
  m.def("rotate_rows(Tensor x, Tensor cos, Tensor sin, int dim, Tensor(a!) out) -> ()");
  m.impl("rotate_rows", c10::DispatchKey::CPU, TORCH_FN(rotate_rows));
  m.def("silu_mul(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
