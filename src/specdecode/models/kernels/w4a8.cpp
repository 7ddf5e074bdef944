// W4A8 matmul for x86 CPUs with AVX2 and FMA (VNNI where the CPU has it): int4 weights (asymmetric, groups of
// 64 inputs) times activations quantized per row and group of 64 to int8.  Why it exists, and the
// measurements: specdecode/models/w4a8.py.
//
// Per row m, channel n and group g, the integer dot of the levels with the int8 inputs is exact (int32),
// and out[m, n] = sum over g, in order, of fma(dot, scale[n, g] * xscale[m, g], ...) then
// fma(offset[n, g], xsum[m, g], ...): one fp32 chain per output.  That makes the kernel row invariant,
// bitwise, by construction: the instructions that gather a dot may differ with the rows in a call (they
// are integer additions), the chain never does, and threads split the output channels, never a sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace {

constexpr int64_t GROUP = 64;    // inputs per weight group and per activation group
constexpr int64_t ROW_TILE = 4;  // rows sharing one unpacked weight group

// x [M, K] -> xq [M, K] int8 with one scale (max |x| / 127) per row and group, and each group's fp32 sum
// (the weights' offsets multiply it).  Scales and sums are stored per tile of 4 rows as [G][4] (zeros for
// rows past M), the order in which a tile's chains read them.
void quantize_rows(const float* x, int64_t M, int64_t G, int8_t* xq, float* scales, float* sums) {
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
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
      const int64_t m = i / G, g = i % G, slot = ((m / ROW_TILE) * G + g) * ROW_TILE + m % ROW_TILE;
      scales[slot] = scale;
      sums[slot] = sum;
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

// How far ahead (in groups, 2.3 KB) the next weights are requested: the hardware prefetcher alone left the loads
// waiting on memory, and 8 groups ahead left a one-token step of qwen2.5-coder-1.5b 10% slower on a 2-core EPYC
// (docs/results/w4a8-prefetch-epyc-qwen2.5-coder-1.5b).
constexpr int64_t PREFETCH_GROUPS = 32;

struct Tile {  // up to 4 quantized rows: int8 inputs [rows, K]; scales and sums [G][4]
  const int8_t* inputs;
  const float* scales;
  const float* sums;
  int64_t K;
  int64_t G;
};

// The 8 lanes' int32 dots of one channel with one row: levels (low and high nibbles) times 64 int8 inputs;
// lane i holds the products of bytes 4i..4i+3 of both halves.  With VNNI (AVX-512 VNNI with VL, or AVX-VNNI)
// one instruction multiplies and sums four bytes into each lane: two instead of four per row and channel, and
// the same integers, so the same bits out.  Without it, AVX2: q in 0..15 times x in -127..127, pairs summed,
// |s| <= 4 * 15 * 127, no int16 saturation.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i group_dot(__m256i low, __m256i high, __m256i x0, __m256i x1) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), low, x0), high, x1);
}
#elif defined(__AVXVNNI__)
inline __m256i group_dot(__m256i low, __m256i high, __m256i x0, __m256i x1) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), low, x0), high, x1);
}
#else
inline __m256i group_dot(__m256i low, __m256i high, __m256i x0, __m256i x1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x0), _mm256_maddubs_epi16(high, x1));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

// Channel pair times R rows (R a compile-time constant, so that everything stays in registers).  Per
// group, the lanes of the dots are summed across in integers (exact), giving one vector of the group's
// dots, which takes one conversion and one fma: scaling each dot on its own took 4 vector and 2 scalar
// operations per row and channel, and bound the kernel from 4 rows on.  Lane c * LANES + r of `out` is
// channel c (a, b) with row r, where LANES (lanes_for) is R rounded up to 1, 2 or 4 (128-bit vectors up to
// 2 rows); lanes of absent rows multiply zeros.
constexpr int lanes_for(int64_t rows) { return rows <= 2 ? static_cast<int>(rows) : 4; }

template <int R>
inline void dot_tile(const PairGroup* w, const Tile& x, float out[8]) {
  constexpr int LANES = lanes_for(R);
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  __m128 acc2 = _mm_setzero_ps();
  for (int64_t g = 0; g < x.G; ++g) {
    const PairGroup& block = w[g];
    _mm_prefetch(reinterpret_cast<const char*>(&block + PREFETCH_GROUPS), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&block + PREFETCH_GROUPS) + 64, _MM_HINT_T0);  // 72 bytes: 2 lines
    const __m256i pa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.levels_a));
    const __m256i pb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.levels_b));
    const __m256i lowa = _mm256_and_si256(pa, low_mask);
    const __m256i higha = _mm256_and_si256(_mm256_srli_epi16(pa, 4), low_mask);
    const __m256i lowb = _mm256_and_si256(pb, low_mask);
    const __m256i highb = _mm256_and_si256(_mm256_srli_epi16(pb, 4), low_mask);
    __m256i dots[2 * LANES];  // channel a's rows, then channel b's
    for (int r = 0; r < LANES; ++r) {
      if (r < R) {
        const int8_t* xg = x.inputs + r * x.K + g * GROUP;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 32));
        dots[r] = group_dot(lowa, higha, x0, x1);
        dots[LANES + r] = group_dot(lowb, highb, x0, x1);
      } else {
        dots[r] = dots[LANES + r] = _mm256_setzero_si256();
      }
    }
    // The 4 bf16 numbers widened to fp32 at once: [scale a, scale b, zero a, zero b].
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&block.scale_a));
    const __m128 numbers = _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), raw));
    const __m128 scales = _mm_movelh_ps(numbers, numbers);  // a b a b
    // 8 * scale is exact, so this is zero - 8 * scale rounded once, whatever the compiler contracts.
    const __m128 offsets = _mm_sub_ps(_mm_movehl_ps(numbers, numbers), _mm_mul_ps(_mm_set1_ps(8.f), scales));
    const __m128 xscales = _mm_loadu_ps(x.scales + g * ROW_TILE), xsums = _mm_loadu_ps(x.sums + g * ROW_TILE);
    // Across lanes: hadd pairs within 128-bit halves, then the halves.  Lane i ends as the sum of dots[i].
    if constexpr (LANES == 1) {
      const __m256i halves = _mm256_hadd_epi32(dots[0], dots[1]);  // a01 a23 b01 b23 | a45 a67 b45 b67
      const __m128i quarter = _mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
      const __m128i sums = _mm_hadd_epi32(quarter, quarter);  // a b a b
      const __m128 steps = _mm_mul_ps(scales, _mm_broadcastss_ps(xscales));
      acc2 = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), steps, acc2);
      acc2 = _mm_fmadd_ps(offsets, _mm_broadcastss_ps(xsums), acc2);
    } else if constexpr (LANES == 2) {
      const __m256i pairs = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3]));
      const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
      const __m128 steps = _mm_mul_ps(_mm_unpacklo_ps(scales, scales), _mm_movelh_ps(xscales, xscales));  // a a b b
      acc2 = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), steps, acc2);
      acc2 = _mm_fmadd_ps(_mm_unpacklo_ps(offsets, offsets), _mm_movelh_ps(xsums, xsums), acc2);
    } else {
      const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3]));
      const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[4], dots[5]), _mm256_hadd_epi32(dots[6], dots[7]));
      const __m256i sums =
          _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
      const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // a a a a b b b b
      const __m256 steps = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(scales), spread),
                                         _mm256_set_m128(xscales, xscales));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), steps, acc);
      acc = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(offsets), spread),
                            _mm256_set_m128(xsums, xsums), acc);
    }
  }
  if constexpr (LANES <= 2)
    _mm_storeu_ps(out, acc2);
  else
    _mm256_storeu_ps(out, acc);
}

}  // namespace

// x [M, K] fp32; blocks [N/2, K/64 * 72] uint8, channel pair p's groups in order (PairGroup).
// Returns x @ w.T, [M, N] fp32.
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor blocks) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), pairs = blocks.size(0), N = 2 * pairs, G = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(1) == G * static_cast<int64_t>(sizeof(PairGroup)),
              "blocks: contiguous [N/2, K/64 * 72] uint8");
  const int64_t tiles = (M + ROW_TILE - 1) / ROW_TILE;
  auto out = torch::empty({M, N}, x.options());
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xscales = torch::zeros({tiles, G, ROW_TILE}, x.options());
  auto xsums = torch::zeros({tiles, G, ROW_TILE}, x.options());
  quantize_rows(x.data_ptr<float>(), M, G, xq.data_ptr<int8_t>(), xscales.data_ptr<float>(), xsums.data_ptr<float>());
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const float* xsp = xscales.data_ptr<float>();
  const float* xup = xsums.data_ptr<float>();
  const PairGroup* wp = reinterpret_cast<const PairGroup*>(blocks.data_ptr<uint8_t>());
  float* outp = out.data_ptr<float>();
  at::parallel_for(0, pairs, 8, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const PairGroup* weights = wp + pair * G;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t m0 = tile * ROW_TILE, rows = std::min(ROW_TILE, M - m0);
        const Tile rows_tile{xqp + m0 * K, xsp + tile * G * ROW_TILE, xup + tile * G * ROW_TILE, K, G};
        float lanes[8];
        switch (rows) {
          case 1: dot_tile<1>(weights, rows_tile, lanes); break;
          case 2: dot_tile<2>(weights, rows_tile, lanes); break;
          case 3: dot_tile<3>(weights, rows_tile, lanes); break;
          default: dot_tile<4>(weights, rows_tile, lanes); break;
        }
        const int64_t lane_rows = lanes_for(rows);
        for (int64_t r = 0; r < rows; ++r) {
          outp[(m0 + r) * N + 2 * pair] = lanes[r];
          outp[(m0 + r) * N + 2 * pair + 1] = lanes[lane_rows + r];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { module.def("w4a8_mm", &w4a8_mm); }
