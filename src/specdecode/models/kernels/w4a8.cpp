// W4A8 matmul for x86 CPUs with AVX2 and FMA (AVX-512 VNNI or AVX-VNNI where the CPU has it): int4 weights
// (asymmetric, groups of 64 inputs) times activations quantized per row and group of 64 to int8.  Why it
// exists, and the measurements: specdecode/models/w4a8.py.
//
// Per row m, channel n and group g, the integer dot of the levels with the int8 inputs is exact (int32),
// and out[m, n] = sum over g, in order, of fma(dot, scale[n, g] * xscale[m, g], ...) then
// fma(offset[n, g], xsum[m, g], ...): one fp32 chain per output.  That makes the kernel row invariant,
// bitwise, by construction: the instructions that gather a dot may differ with the rows in a call and with
// the instruction set (they are integer additions), the chain never does, and threads split the output
// channels, never a sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t GROUP = 64;  // inputs per weight group and per activation group
constexpr int64_t LANES = 16;  // output channels per block: one lane each

// One group of one block of 16 output channels, as the weights are laid out: each block is one contiguous
// run of these, in group order, so a thread streams one sequential region per block.  The channels sit in
// the lanes of a vector, so one instruction multiplies 16 channels by the same 4 inputs (broadcast) and a
// channel's dot never needs a sum across lanes.
struct BlockGroup {
  // levels[j]: 16 lanes of 4 bytes, lane c = channel c; byte b of lane c holds the level of input 4j + b in
  // its low nibble and that of input 32 + 4j + b in its high one.
  uint8_t levels[8][LANES * 4];
  uint16_t scales[LANES];  // bf16 bits, as int4_levels rounded them; w = (q - 8) * scale + zero
  uint16_t zeros[LANES];
};
static_assert(sizeof(BlockGroup) == 576, "the Python side packs 576-byte groups");

// How far ahead (in groups of one block, 576 bytes each) the next weights are requested.  From 2 to 16 groups
// ahead, calls of 1 to 4 rows read weights out of the caches equally fast on a 2-core EPYC, 44-46 GB/s
// (docs/results/w4a8-lanes-epyc-qwen2.5-coder-1.5b, prefetch.json).
constexpr int64_t PREFETCH_GROUPS = 8;

// x [M, K] -> xq [M, K] int8 with one scale (max |x| / 127) per row and group, and each group's fp32 sum
// (the weights' offsets multiply it), both [M, G].  The sum adds the 8 vectors of a group pairwise, then the
// lanes' halves: one fixed order in every build of the kernel (all have AVX2), so the builds agree bitwise;
// summed one input after another, it was a chain of 64 dependent additions that took most of a long
// prompt's time in its narrow layers.
void quantize_rows(const float* x, int64_t M, int64_t G, int8_t* xq, float* scales, float* sums) {
  at::parallel_for(0, M * G, 16, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * GROUP;
      __m256 v[8];
      for (int k = 0; k < 8; ++k) v[k] = _mm256_loadu_ps(src + 8 * k);
      __m256 amax = _mm256_andnot_ps(sign, v[0]);
      for (int k = 1; k < 8; ++k) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
      __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
      amax4 = _mm_max_ss(amax4, _mm_movehdup_ps(amax4));
      const __m256 total = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])),
                                         _mm256_add_ps(_mm256_add_ps(v[4], v[5]), _mm256_add_ps(v[6], v[7])));
      __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
      sum4 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
      sum4 = _mm_add_ss(sum4, _mm_movehdup_ps(sum4));
      const float scale = _mm_cvtss_f32(amax4) / 127.f;
      const __m256 inverse = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      __m256i levels[8];  // rounded to nearest even, as nearbyint: |levels| <= 127, no saturation below
      for (int k = 0; k < 8; ++k) levels[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
      for (int half = 0; half < 2; ++half) {
        const __m256i* l = levels + 4 * half;
        // The packs interleave 128-bit lanes: dword d of the result holds 4 of the bytes; put them back in order.
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(l[0], l[1]), _mm256_packs_epi32(l[2], l[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * GROUP + 32 * half), ordered);
      }
      scales[i] = scale;
      sums[i] = _mm_cvtss_f32(sum4);
    }
  });
}

// 4 input bytes as one int32, for a broadcast to every lane.
inline int32_t four_bytes(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return four;
}

// The vector operations a tile needs, at one width.  `dots` adds, per 32-bit lane, the products of the lane's 4
// unsigned bytes of low levels (0..15) with 4 signed bytes of inputs, and those of its high levels with 4 more
// inputs: one instruction for each with VNNI; with AVX2 alone a multiply-add of byte pairs for each, their sum in
// int16 (|s| <= 4 * 15 * 127, no saturation) and one multiply-add of int16 pairs.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
struct Wide {  // 16 lanes: one block at a time
  using I = __m512i;
  using F = __m512;
  static constexpr int LANES_PER = 16;
  static constexpr int MAX_ROWS = 8;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high(I v) { return _mm512_srli_epi16(v, 4); }
  static I zero() { return _mm512_setzero_si512(); }
  static I broadcast(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }
  static I dots(I acc, I low, I low_inputs, I high, I high_inputs) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, low, low_inputs), high, high_inputs);
  }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static F bf16(const uint16_t* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static F fzero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static void store(float* p, F v, int lanes) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << lanes) - 1), v);
  }
};
using Vec = Wide;
#else
struct Narrow {  // 8 lanes: a block in two halves
  using I = __m256i;
  using F = __m256;
  static constexpr int LANES_PER = 8;
  static constexpr int MAX_ROWS = 4;  // 16 registers
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high(I v) { return _mm256_srli_epi16(v, 4); }
  static I zero() { return _mm256_setzero_si256(); }
  static I broadcast(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }
#if defined(__AVXVNNI__)
  static I dots(I acc, I low, I low_inputs, I high, I high_inputs) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, low, low_inputs), high, high_inputs);
  }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  static I dots(I acc, I low, I low_inputs, I high, I high_inputs) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, low, low_inputs), high, high_inputs);
  }
#else
  static I dots(I acc, I low, I low_inputs, I high, I high_inputs) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, low_inputs), _mm256_maddubs_epi16(high, high_inputs));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
#endif
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static F bf16(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static void store(float* p, F v, int lanes) {
    if (lanes >= 8) {
      _mm256_storeu_ps(p, v);
    } else if (lanes > 0) {
      float all[8];
      _mm256_storeu_ps(all, v);
      std::memcpy(p, all, lanes * sizeof(float));
    }
  }
};
using Vec = Narrow;
#endif

struct Rows {  // up to MAX_ROWS quantized rows: int8 inputs [rows, K]; scales and sums [rows, G]
  const int8_t* inputs;
  const float* scales;
  const float* sums;
  int64_t K;
  int64_t G;
};

// One block's channels from lane `offset` on, PARTS vectors of them side by side, times R rows (compile-time
// constants, so that everything stays in registers), into out[r * ldo + lane] for the first `lanes` lanes.  Under
// 4 rows each row's dot gathers in 2 or 4 independent chains (the vectors side by side count as chains); the chains
// meet in exact integer additions.
template <int R, int PARTS>
void block_rows(const BlockGroup* w, const Rows& x, int offset, float* out, int64_t ldo, int lanes) {
  using V = Vec;
  constexpr int CHAINS = std::max(1, (R == 1 ? 4 : (R < 4 ? 2 : 1)) / PARTS);  // integer sums per row and vector
  typename V::F acc[R][PARTS];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < PARTS; ++p) acc[r][p] = V::fzero();
  for (int64_t g = 0; g < x.G; ++g) {
    const BlockGroup& block = w[g];
    const char* ahead = reinterpret_cast<const char*>(&block + PREFETCH_GROUPS);
    typename V::I dots[R][PARTS][CHAINS];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < PARTS; ++p)
        for (int c = 0; c < CHAINS; ++c) dots[r][p][c] = V::zero();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
      for (int p = 0; p < PARTS; ++p) {
        const typename V::I packed = V::load(block.levels[j] + 4 * (offset + p * V::LANES_PER));
        const typename V::I low = V::nibbles(packed), high = V::nibbles(V::high(packed));
        for (int r = 0; r < R; ++r) {
          const int8_t* inputs = x.inputs + r * x.K + g * GROUP + 4 * j;
          typename V::I& sum = dots[r][p][j % CHAINS];
          sum = V::dots(sum, low, V::broadcast(inputs), high, V::broadcast(inputs + 32));
        }
      }
    }
    _mm_prefetch(ahead + 512, _MM_HINT_T0);
    for (int p = 0; p < PARTS; ++p) {
      const int first = offset + p * V::LANES_PER;
      const typename V::F scales = V::bf16(block.scales + first);
      // 8 * scale is exact, so this is zero - 8 * scale rounded once, whatever the compiler contracts.
      const typename V::F offsets = V::sub(V::bf16(block.zeros + first), V::mul(V::set1(8.f), scales));
      for (int r = 0; r < R; ++r) {
        typename V::I sum = dots[r][p][0];
        for (int c = 1; c < CHAINS; ++c) sum = V::add(sum, dots[r][p][c]);
        const typename V::F steps = V::mul(scales, V::set1(x.scales[r * x.G + g]));
        acc[r][p] = V::fma(V::to_float(sum), steps, acc[r][p]);
        acc[r][p] = V::fma(offsets, V::set1(x.sums[r * x.G + g]), acc[r][p]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < PARTS; ++p)
      V::store(out + r * ldo + p * V::LANES_PER, acc[r][p], std::min(lanes - p * V::LANES_PER, V::LANES_PER));
}

// A block times R rows.  Where a vector holds half a block (AVX2), one or two rows take both halves in one pass
// over the weights, which then stream from memory once; more rows take a pass per half, whose second reads the
// block from the caches (the registers hold too few accumulators for both).
template <int R>
void block_tile(const BlockGroup* w, const Rows& x, float* out, int64_t ldo, int lanes) {
  constexpr int VECTORS = LANES / Vec::LANES_PER;
  if constexpr (VECTORS > 1 && R <= 2) {
    block_rows<R, VECTORS>(w, x, 0, out, ldo, lanes);
  } else {
    for (int offset = 0; offset < LANES; offset += Vec::LANES_PER)
      block_rows<R, 1>(w, x, offset, out + offset, ldo, std::min(lanes - offset, Vec::LANES_PER));
  }
}

using TileFn = void (*)(const BlockGroup*, const Rows&, float*, int64_t, int);

template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {block_tile<R + 1>...};
}

constexpr auto TILES = tile_table(std::make_integer_sequence<int, Vec::MAX_ROWS>{});

}  // namespace

// x [M, K] fp32; blocks [at least ceil(N/16), K/64 * 576] uint8, block b's groups in order (BlockGroup).
// Returns x @ w.T, [M, N] fp32: the first N channels of the blocks.
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor blocks, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), count = blocks.size(0), G = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(1) == G * static_cast<int64_t>(sizeof(BlockGroup)),
              "blocks: contiguous [N/16, K/64 * 576] uint8");
  // Only the blocks the first N channels need are read: layers fused along their blocks (QuantizedLinear.fused) whose
  // parts end in padded blocks come out scrambled, which the fusing side detects by a probe, rather than failing here.
  TORCH_CHECK(N >= 1 && N <= count * LANES, "N must be at least 1 and fit the blocks");
  const int64_t used = (N + LANES - 1) / LANES;
  auto out = torch::empty({M, N}, x.options());
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xscales = torch::empty({M, G}, x.options());
  auto xsums = torch::empty({M, G}, x.options());
  quantize_rows(x.data_ptr<float>(), M, G, xq.data_ptr<int8_t>(), xscales.data_ptr<float>(), xsums.data_ptr<float>());
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const float* xsp = xscales.data_ptr<float>();
  const float* xup = xsums.data_ptr<float>();
  const BlockGroup* wp = reinterpret_cast<const BlockGroup*>(blocks.data_ptr<uint8_t>());
  float* outp = out.data_ptr<float>();
  at::parallel_for(0, used, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int lanes = static_cast<int>(std::min(LANES, N - b * LANES));
      for (int64_t m0 = 0; m0 < M; m0 += Vec::MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(Vec::MAX_ROWS, M - m0);
        const Rows tile{xqp + m0 * K, xsp + m0 * G, xup + m0 * G, K, G};
        TILES[rows - 1](wp + b * G, tile, outp + m0 * N + b * LANES, N, lanes);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { module.def("w4a8_mm", &w4a8_mm); }
