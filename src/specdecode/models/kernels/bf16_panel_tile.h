// The bf16 panel product's tile: rows of bf16 inputs times panels of 16 output channels' bf16 weights, accumulating in
// fp32, by one of two products with the same bits.  Used by the bf16 linear layers (bf16_panel_linear.cpp) and by the
// greedy head's bf16 screen of the LM head (greedy_head.cpp).
//
// Layout: a row's inputs as pairs [half] (inputs 2k and 2k + 1 of the row in one 32-bit word); a panel's weights as
// pairs [half][16] (step k: channel c's weights at inputs 2k and 2k + 1 side by side).  Numerics: output (r, c) is one
// chain over k = 0, 1, ..., half - 1 from zero, step k adding the product at input 2k + 1, then the one at 2k, each sum
// rounded to fp32 (a product of two bf16 numbers is exact in fp32), whatever the tile, the number of rows or the
// thread: a row gets the same bits alone as in any batch.
//
// The two products: AVX512_BF16's dot product of pairs (vdpbf16ps, one instruction a step), or the pairs widened to
// fp32 and multiplied-added (`Widened`: two multiply-adds a step, the rows widened once a call).  Both add in that
// order (checked bitwise on an Intel Xeon against vdpbf16ps, which also flushes subnormal numbers to zero: only sums
// below fp32's normal range can differ).  Which is faster depends on the CPU: an Intel Xeon without AMX runs one
// vdpbf16ps in the time of four multiply-adds, so the dot product does half the work of the widened one in the same
// time (docs/results/bf16-widened-xeon-smollm2-135m), where on an AMD EPYC the dot product multiplied 128 rows 1.9-2.2x
// faster than the fp32 panels (docs/results/bf16-panels-smollm2-135m).  cpu_kernels.py times both once per process.
// Callers check the CPU has AVX512_BF16.
#pragma once

#if defined(__x86_64__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <memory>

#include "panel_tile.h"

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace specdecode {

// Most rows a tile takes: 12 rows x 2 panels of sums, the two panels' weights and an input in 27 of the 32 vector
// registers.  Rows are cut into blocks as even as possible: a block reads its panels once, and a block of a few rows
// waits on its sums' chains (with blocks of 8 and a tail, a bf16 forward of SmolLM2 over 9-12 rows cost 7-10% more:
// docs/results/panel-row-blocks-epyc-smollm2-135m).
constexpr int BF16_ROW_BLOCK = 12;

// Rows [0, R) of x (bf16 pairs, [R, half]) times bf16 panels [panel, panel + G) ([panels, half, 16] pairs) into out
// (row stride `channels`), asking for NEXT of `next`'s lines a step (panel_tile.h).
template <int R, int G, int NEXT>
BF16_TARGET inline void bf16_tile(const uint32_t* x, const uint32_t* w, int64_t half, int64_t channels, int64_t panel,
                                  float* out, const NextPanels& next) {
  __m512 sums[R][G];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) sums[r][g] = _mm512_setzero_ps();
  }
  const uint32_t* panels[G];
  for (int g = 0; g < G; ++g) panels[g] = w + (panel + g) * half * 16;
  for (int64_t k = 0; k < half; ++k) {
    __m512i weights[G];
    for (int g = 0; g < G; ++g) {
      __builtin_prefetch(panels[g] + (k + PREFETCH_STEPS) * 16);
      weights[g] = _mm512_loadu_si512(panels[g] + k * 16);
    }
    prefetch_next<NEXT>(next, k);
    for (int r = 0; r < R; ++r) {
      const __m512i input = _mm512_set1_epi32(static_cast<int>(x[r * half + k]));
      for (int g = 0; g < G; ++g) sums[r][g] = _mm512_dpbf16_ps(sums[r][g], (__m512bh)input, (__m512bh)weights[g]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + r * channels + (panel + g) * 16, sums[r][g]);
  }
}

// Rows widened to fp32 ([rows, 2 half], each bf16 number exactly), for the widened product.
struct Widened {
  const float* x;
};

// Rows [0, R) of the widened rows times bf16 panels [panel, panel + G) into out, the pairs widened in registers: the
// same chains as the dot product's tile above, by multiply-adds.
template <int R, int G, int NEXT>
BF16_TARGET inline void bf16_tile(Widened rows, const uint32_t* w, int64_t half, int64_t channels, int64_t panel,
                                  float* out, const NextPanels& next) {
  const float* x = rows.x;
  __m512 sums[R][G];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) sums[r][g] = _mm512_setzero_ps();
  }
  const uint32_t* panels[G];
  for (int g = 0; g < G; ++g) panels[g] = w + (panel + g) * half * 16;
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < half; ++k) {
    __m512 odd[G], even[G];
    for (int g = 0; g < G; ++g) {
      __builtin_prefetch(panels[g] + (k + PREFETCH_STEPS) * 16);
      const __m512i pairs = _mm512_loadu_si512(panels[g] + k * 16);
      odd[g] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_halves));
      even[g] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    }
    prefetch_next<NEXT>(next, k);
    for (int r = 0; r < R; ++r) {
      const float* input = x + r * 2 * half + 2 * k;
      for (int g = 0; g < G; ++g) sums[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(input[1]), odd[g], sums[r][g]);
      for (int g = 0; g < G; ++g) sums[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(input[0]), even[g], sums[r][g]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + r * channels + (panel + g) * 16, sums[r][g]);
  }
}

// Row r of x: bf16 pairs, or rows widened to fp32.
inline const uint32_t* row_of(const uint32_t* x, int64_t r, int64_t half) { return x + r * half; }
inline Widened row_of(Widened x, int64_t r, int64_t half) { return {x.x + r * 2 * half}; }

// A block of `block` rows (at most BF16_ROW_BLOCK) as one tile.
template <int G, int NEXT, typename Rows>
BF16_TARGET inline void bf16_block(int64_t block, Rows xr, const uint32_t* w, int64_t half, int64_t channels,
                                   int64_t panel, float* o, const NextPanels& next) {
  switch (block) {
    case 1: bf16_tile<1, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 2: bf16_tile<2, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 3: bf16_tile<3, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 4: bf16_tile<4, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 5: bf16_tile<5, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 6: bf16_tile<6, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 7: bf16_tile<7, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 8: bf16_tile<8, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 9: bf16_tile<9, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 10: bf16_tile<10, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    case 11: bf16_tile<11, G, NEXT>(xr, w, half, channels, panel, o, next); break;
    default: bf16_tile<12, G, NEXT>(xr, w, half, channels, panel, o, next); break;
  }
}

// Every row of x times panels [pair * 2, pair * 2 + G) of a thread's pairs [.., end) of w's `panels`.
template <int G, typename Rows>
BF16_TARGET inline void bf16_rows(int64_t rows, Rows x, const uint32_t* w, int64_t half, int64_t panels,
                                  int64_t pair, int64_t end, float* out) {
  const int64_t blocks = (rows + BF16_ROW_BLOCK - 1) / BF16_ROW_BLOCK, channels = panels * 16, panel = pair * 2;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r = b * rows / blocks, block = (b + 1) * rows / blocks - r;
    const NextPanels next = next_panels(w, half, panels, pair, end, b, blocks);
    if (blocks == 1) {
      bf16_block<G, G>(block, row_of(x, r, half), w, half, channels, panel, out + r * channels, next);
    } else {
      bf16_block<G, 1>(block, row_of(x, r, half), w, half, channels, panel, out + r * channels, next);
    }
  }
}

// Every row of x times the panels of pairs [begin, end) of w's `panels` (pair p: panels 2p and 2p + 1, or 2p alone when
// it is the last): the unit of work of the callers' threads.  x: bf16 pairs [rows, half], or (Widened) the rows widened
// to fp32 by widen_rows.
template <typename Rows>
BF16_TARGET inline void bf16_pairs(int64_t rows, Rows x, const uint32_t* w, int64_t half, int64_t panels,
                                   int64_t begin, int64_t end, float* out) {
  for (int64_t pair = begin; pair < end; ++pair) {
    if (pair * 2 + 2 <= panels) {
      bf16_rows<2>(rows, x, w, half, panels, pair, end, out);
    } else {
      bf16_rows<1>(rows, x, w, half, panels, pair, end, out);
    }
  }
}

// The fewest rows the widened product takes: with fewer, each sum's two multiply-adds a step wait on each other and
// vdpbf16ps's one instruction a step is faster; at four rows a whole bf16 forward of SmolLM2-135M costs the same by
// either product on an Intel Xeon without AMX (docs/results/bf16-widened-xeon-smollm2-135m).  The bits are the same.
constexpr int64_t WIDENED_MIN_ROWS = 4;

// Every row of x (bf16 pairs [rows, half]) times all `panels` of w into out [rows, panels * 16], on torch's threads: by
// the widened product where `widened` and there are WIDENED_MIN_ROWS rows or more, else by vdpbf16ps.
BF16_TARGET inline void bf16_product(int64_t rows, const uint32_t* x, const uint32_t* w, int64_t half, int64_t panels,
                                     float* out, bool widened) {
  if (widened && rows >= WIDENED_MIN_ROWS) {
    std::unique_ptr<float[]> wide(new float[rows * half * 2]);  // every number written below, none zeroed first
    for (int64_t i = 0; i < rows * half; ++i) {  // each number exactly: bf16 is fp32's upper half
      const uint32_t even = x[i] << 16, odd = x[i] & 0xFFFF0000u;
      std::memcpy(&wide[2 * i], &even, sizeof even);
      std::memcpy(&wide[2 * i + 1], &odd, sizeof odd);
    }
    at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      bf16_pairs(rows, Widened{wide.get()}, w, half, panels, begin, end, out);
    });
  } else {
    at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      bf16_pairs(rows, x, w, half, panels, begin, end, out);
    });
  }
}

}  // namespace specdecode

#endif  // __x86_64__
