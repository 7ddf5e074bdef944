// W4A8 matmul for x86 CPUs with AVX2 and FMA: int4 weights (asymmetric, groups of 64 inputs) times
// activations quantized per row and group of 64 to int8, accumulated in int32 within a group and in fp32
// across groups.  Why it exists, and the measurements: specdecode/models/w4a8.py.
//
// Row invariance, bitwise: out[m, n] is computed by the same instructions in the same order whatever the
// number of rows in the call and the number of threads.  Threads split the output channels (never the
// reduction), a row's activation scales depend on that row alone, and a row tile only changes which rows
// share a weight load.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace {

constexpr int64_t GROUP = 64;     // inputs per weight group and per activation group
constexpr int64_t ROW_TILE = 4;   // rows sharing one unpacked weight group

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  low = _mm_add_ss(low, _mm_shuffle_ps(low, low, 1));
  return _mm_cvtss_f32(low);
}

// x [M, K] -> xq [M, K] int8 with one scale (max |x| / 127) per row and group, and each group's fp32 sum
// (the weights' offsets multiply it).
void quantize_rows(const float* x, int64_t groups, int8_t* xq, float* scales, float* sums) {
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * GROUP;
      float amax = 0.f, sum = 0.f;
      for (int64_t k = 0; k < GROUP; ++k) {
        amax = std::max(amax, std::fabs(src[k]));
        sum += src[k];
      }
      const float scale = amax / 127.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;
      for (int64_t k = 0; k < GROUP; ++k) xq[i * GROUP + k] = static_cast<int8_t>(std::nearbyint(src[k] * inverse));
      scales[i] = scale;
      sums[i] = sum;
    }
  });
}

}  // namespace

// x [M, K] fp32; nibbles [N, K/2] uint8, where byte j of group g holds q[g*64 + j] in its low nibble and
// q[g*64 + 32 + j] in its high one; scales, offsets [N, K/64] fp32, so that w = q * scale + offset.
// Returns x @ w.T, [M, N] fp32.
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor nibbles, torch::Tensor scales, torch::Tensor offsets) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), N = nibbles.size(0), G = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(nibbles.scalar_type() == torch::kUInt8 && nibbles.is_contiguous() && nibbles.size(1) * 2 == K,
              "nibbles: contiguous [N, K/2] uint8");
  TORCH_CHECK(scales.is_contiguous() && offsets.is_contiguous() && scales.size(0) == N && scales.size(1) == G &&
                  offsets.sizes() == scales.sizes() && scales.scalar_type() == torch::kFloat &&
                  offsets.scalar_type() == torch::kFloat,
              "scales, offsets: contiguous [N, K/64] fp32");
  auto out = torch::empty({M, N}, x.options());
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xscales = torch::empty({M, G}, x.options());
  auto xsums = torch::empty({M, G}, x.options());
  quantize_rows(x.data_ptr<float>(), M * G, xq.data_ptr<int8_t>(), xscales.data_ptr<float>(), xsums.data_ptr<float>());
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const float* xsp = xscales.data_ptr<float>();
  const float* xup = xsums.data_ptr<float>();
  const uint8_t* wp = nibbles.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  // Two output channels at a time: each activation load serves both, and their dependency chains interleave.
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t begin, int64_t end) {
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n = 2 * pair;
      const int64_t channels = std::min<int64_t>(2, N - n);
      const uint8_t* wa = wp + n * (K / 2);
      const uint8_t* wb = channels == 2 ? wa + K / 2 : wa;
      const float* sa = sp + n * G;
      const float* sb = channels == 2 ? sa + G : sa;
      for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
        const int64_t rows = std::min(ROW_TILE, M - m0);
        __m256 acca[ROW_TILE], accb[ROW_TILE];
        for (int64_t r = 0; r < ROW_TILE; ++r) acca[r] = accb[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
          const __m256i pa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wa + g * 32));
          const __m256i pb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 32));
          const __m256i lowa = _mm256_and_si256(pa, low_mask);
          const __m256i higha = _mm256_and_si256(_mm256_srli_epi16(pa, 4), low_mask);
          const __m256i lowb = _mm256_and_si256(pb, low_mask);
          const __m256i highb = _mm256_and_si256(_mm256_srli_epi16(pb, 4), low_mask);
          const float scalea = sa[g], scaleb = sb[g];
          for (int64_t r = 0; r < rows; ++r) {
            const int8_t* xg = xqp + (m0 + r) * K + g * GROUP;
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
            const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 32));
            const float xscale = xsp[(m0 + r) * G + g];
            // q in 0..15 times x in -127..127, pairs summed: |s| <= 4 * 15 * 127, no int16 saturation.
            const __m256i suma = _mm256_add_epi16(_mm256_maddubs_epi16(lowa, x0), _mm256_maddubs_epi16(higha, x1));
            const __m256i sumb = _mm256_add_epi16(_mm256_maddubs_epi16(lowb, x0), _mm256_maddubs_epi16(highb, x1));
            acca[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(suma, ones)),
                                      _mm256_set1_ps(scalea * xscale), acca[r]);
            accb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sumb, ones)),
                                      _mm256_set1_ps(scaleb * xscale), accb[r]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* xsum = xup + (m0 + r) * G;
          for (int64_t c = 0; c < channels; ++c) {
            const float* offset = op + (n + c) * G;
            float shift = 0.f;
            for (int64_t g = 0; g < G; ++g) shift += offset[g] * xsum[g];
            outp[(m0 + r) * N + n + c] = horizontal_sum(c == 0 ? acca[r] : accb[r]) + shift;
          }
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { module.def("w4a8_mm", &w4a8_mm); }
