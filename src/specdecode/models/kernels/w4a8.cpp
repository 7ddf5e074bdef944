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
#include <cstring>

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

// One group of two output channels, as the weights are laid out: each channel pair is one contiguous run of
// these, in group order, so a thread streams one sequential region per pair (with separate arrays for the
// levels, scales and offsets the kernel read four streams at a time and reached half the memory bandwidth).
// Scales and zeros stay in bf16, as int4_levels rounded them: 72 bytes per group instead of 80 with fp32
// offsets, and reading the weights is what a one-row call waits for.
struct PairGroup {
  uint8_t levels_a[32];  // byte j: level j in the low nibble, level 32 + j in the high one
  uint8_t levels_b[32];
  uint16_t scale_a, scale_b, zero_a, zero_b;  // bf16 bits; w = (q - 8) * scale + zero
};
static_assert(sizeof(PairGroup) == 72, "the Python side packs 72-byte groups");

inline float from_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

struct Rows {  // a tile of quantized rows: int8 inputs [rows, K], their scales and fp32 sums [rows, G]
  const int8_t* inputs;
  const float* scales;
  const float* sums;
  int64_t K;
  int64_t G;
};

// How far ahead (in groups) the next weights are requested: the hardware prefetcher alone left the loads
// waiting on memory.
constexpr int64_t PREFETCH_GROUPS = 8;

// The dot products of R rows with one channel pair.  R is a compile-time constant so that the accumulators
// stay in registers; each row's arithmetic is the same for every R.  The offsets' term (offset times the
// group's fp32 sum) is a scalar chain per row and channel, summed in the same loop so that its latency
// hides behind the vector work: summed after the loop it took as long as the integer dots.
template <int R>
inline void dot_tile(const PairGroup* w, const Rows& x, float dots[2][ROW_TILE]) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acca[R], accb[R];
  float shifta[R], shiftb[R];
  for (int r = 0; r < R; ++r) {
    acca[r] = accb[r] = _mm256_setzero_ps();
    shifta[r] = shiftb[r] = 0.f;
  }
  for (int64_t g = 0; g < x.G; ++g) {
    const PairGroup& block = w[g];
    _mm_prefetch(reinterpret_cast<const char*>(&block + PREFETCH_GROUPS), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&block + PREFETCH_GROUPS) + 64, _MM_HINT_T0);  // 72 bytes span 2 lines
    // 8 * scale is exact, so the offset is the same float however the compiler contracts this.
    const float scalea = from_bf16(block.scale_a), scaleb = from_bf16(block.scale_b);
    const float offseta = from_bf16(block.zero_a) - 8.f * scalea, offsetb = from_bf16(block.zero_b) - 8.f * scaleb;
    const __m256i pa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.levels_a));
    const __m256i pb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.levels_b));
    const __m256i lowa = _mm256_and_si256(pa, low_mask);
    const __m256i higha = _mm256_and_si256(_mm256_srli_epi16(pa, 4), low_mask);
    const __m256i lowb = _mm256_and_si256(pb, low_mask);
    const __m256i highb = _mm256_and_si256(_mm256_srli_epi16(pb, 4), low_mask);
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = x.inputs + r * x.K + g * GROUP;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 32));
      const float xscale = x.scales[r * x.G + g], xsum = x.sums[r * x.G + g];
      shifta[r] += offseta * xsum;
      shiftb[r] += offsetb * xsum;
      // q in 0..15 times x in -127..127, pairs summed: |s| <= 4 * 15 * 127, no int16 saturation.
      const __m256i suma = _mm256_add_epi16(_mm256_maddubs_epi16(lowa, x0), _mm256_maddubs_epi16(higha, x1));
      const __m256i sumb = _mm256_add_epi16(_mm256_maddubs_epi16(lowb, x0), _mm256_maddubs_epi16(highb, x1));
      acca[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(suma, ones)),
                                _mm256_set1_ps(scalea * xscale), acca[r]);
      accb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sumb, ones)),
                                _mm256_set1_ps(scaleb * xscale), accb[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    dots[0][r] = horizontal_sum(acca[r]) + shifta[r];
    dots[1][r] = horizontal_sum(accb[r]) + shiftb[r];
  }
}

}  // namespace

// x [M, K] fp32; blocks [N/2, K/64 * 72] uint8, channel pair p's groups in order (PairGroup).  Returns x @ w.T, [M, N] fp32.
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor blocks) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), pairs = blocks.size(0), N = 2 * pairs, G = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(1) == G * static_cast<int64_t>(sizeof(PairGroup)),
              "blocks: contiguous [N/2, K/64 * 72] uint8");
  auto out = torch::empty({M, N}, x.options());
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xscales = torch::empty({M, G}, x.options());
  auto xsums = torch::empty({M, G}, x.options());
  quantize_rows(x.data_ptr<float>(), M * G, xq.data_ptr<int8_t>(), xscales.data_ptr<float>(), xsums.data_ptr<float>());
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const float* xsp = xscales.data_ptr<float>();
  const float* xup = xsums.data_ptr<float>();
  const PairGroup* wp = reinterpret_cast<const PairGroup*>(blocks.data_ptr<uint8_t>());
  float* outp = out.data_ptr<float>();
  // Two output channels at a time: each activation load serves both, and their dependency chains interleave.
  at::parallel_for(0, pairs, 8, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const PairGroup* weights = wp + pair * G;
      for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
        const int64_t rows = std::min(ROW_TILE, M - m0);
        float dots[2][ROW_TILE];
        const Rows tile{xqp + m0 * K, xsp + m0 * G, xup + m0 * G, K, G};
        switch (rows) {
          case 1: dot_tile<1>(weights, tile, dots); break;
          case 2: dot_tile<2>(weights, tile, dots); break;
          case 3: dot_tile<3>(weights, tile, dots); break;
          default: dot_tile<4>(weights, tile, dots); break;
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < 2; ++c) outp[(m0 + r) * N + 2 * pair + c] = dots[c][r];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { module.def("w4a8_mm", &w4a8_mm); }
