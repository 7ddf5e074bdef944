// The panel product's tile (panel_linear.cpp), shared with the prompt chunk's attention (chunk_attention.cpp), whose
// scores are the same product with the keys packed as panels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace specdecode {

// Most rows a tile takes.  Rows are cut into blocks as even as possible (bf16_panel_tile.h says why).
#if defined(__AVX512F__)
constexpr int ROW_BLOCK = 12;  // 12 rows x 2 panels: 24 of the 32 vector registers hold sums
#else
// 6 rows x 1 panel of two registers: 12 of the 16 hold sums, 2 the panel's step and 1 an input, each step 8 loads for 12
// multiply-adds (3 rows x 2 panels needed 17 registers: GCC read one panel's weights from memory in every multiply-add,
// and 16 rows took 6 blocks; fp32 forwards of 4-16 rows cost 1-8% less with 6 x 1 in an AVX2 build,
// docs/results/avx2-tile-6x1-smollm2-135m).
constexpr int ROW_BLOCK = 6;
#endif
constexpr int PARTS = 16 / LANES;  // vectors of a panel's 16 channels
constexpr int64_t PREFETCH_STEPS = 32;  // steps (64-byte lines) ahead of each panel's stream

// A thread multiplies its panels a pair at a time (the last maybe alone), every step of a panel one 64-byte line.  While
// it multiplies one pair it asks for the lines of its next pair, spread over the pair's row blocks: with one block, G
// lines a step; with several, one line a step in the first blocks, until all are asked for.  Each block's multiply-adds
// then run while memory streams; with only the prefetch PREFETCH_STEPS ahead within a panel, the blocks after the first
// read the pair from the cache while memory stood idle: a bf16 forward of SmolLM2-135M over 16 rows cost 1.47 one-row
// forwards against 1.30 now, over 6-12 rows 3-9% more (docs/results/panel-prefetch-next-pair-epyc-smollm2-135m).
struct NextPanels {
  const char* lines = nullptr;  // the next pair's first line; none when the thread has no next pair
  int64_t first_line = 0;       // the first line the block asks for
  int64_t end_line = 0;         // the pair's lines (0: none to ask for)
};

// The NextPanels of row block `block` of `blocks` over pair `pair` of a thread's pairs [.., end): `panels` panels of
// `steps` lines each from `w`.
inline NextPanels next_panels(const void* w, int64_t steps, int64_t panels, int64_t pair, int64_t end, int64_t block,
                              int64_t blocks) {
  const int64_t first = pair * 2 + 2;
  if (pair + 1 >= end || first >= panels) return {};
  const char* lines = static_cast<const char*>(w) + first * steps * 64;
  return {lines, blocks == 1 ? 0 : block * steps, std::min<int64_t>(panels - first, 2) * steps};
}

// Step k's share of `next`: PER_STEP lines.
template <int PER_STEP>
inline void prefetch_next(const NextPanels& next, int64_t k) {
  for (int j = 0; j < PER_STEP; ++j) {
    const int64_t line = next.first_line + k * PER_STEP + j;
    if (line < next.end_line) __builtin_prefetch(next.lines + line * 64);
  }
}

// Rows [0, R) of x times panels [panel, panel + G) of w into out (row stride `channels`), asking for NEXT of `next`'s
// lines a step.
template <int R, int G, int NEXT>
inline void tile(const float* x, const float* w, int64_t in, int64_t channels, int64_t panel, float* out,
                 const NextPanels& next) {
  vec sums[R][G * PARTS];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < G * PARTS; ++j) sums[r][j] = vec{};
  }
  const float* panels[G];
  for (int g = 0; g < G; ++g) panels[g] = w + (panel + g) * in * 16;
  for (int64_t k = 0; k < in; ++k) {
    vec weights[G * PARTS];
    for (int g = 0; g < G; ++g) {
      __builtin_prefetch(panels[g] + (k + PREFETCH_STEPS) * 16);
      for (int part = 0; part < PARTS; ++part) weights[g * PARTS + part] = load(panels[g] + k * 16 + part * LANES);
    }
    prefetch_next<NEXT>(next, k);
    for (int r = 0; r < R; ++r) {
      const vec input = broadcast(x[r * in + k]);
      for (int j = 0; j < G * PARTS; ++j) sums[r][j] += input * weights[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < G * PARTS; ++j) store(out + r * channels + panel * 16 + j * LANES, sums[r][j]);
  }
}

template <int G, int NEXT>
void row_block(int64_t rows, const float* x, const float* w, int64_t in, int64_t channels, int64_t panel, float* out,
               const NextPanels& next) {
  switch (rows) {
    case 1: tile<1, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 2: tile<2, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 3: tile<3, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 4: tile<4, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 5: tile<5, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 6: tile<6, G, NEXT>(x, w, in, channels, panel, out, next); break;
#if defined(__AVX512F__)
    case 7: tile<7, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 8: tile<8, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 9: tile<9, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 10: tile<10, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 11: tile<11, G, NEXT>(x, w, in, channels, panel, out, next); break;
    case 12: tile<12, G, NEXT>(x, w, in, channels, panel, out, next); break;
#endif
    default: break;
  }
}

// Every row of x times panels [panel, panel + G) of pair `pair` of a thread's pairs [.., end) of w's `panels`: blocks of
// at most ROW_BLOCK rows, as even as possible, the panels' weights staying in the cache from one block to the next.
template <int G>
void panel_group(int64_t rows, const float* x, const float* w, int64_t in, int64_t channels, int64_t panels,
                 int64_t pair, int64_t end, float* out) {
  const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK, panel = pair * 2;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r = b * rows / blocks, block = (b + 1) * rows / blocks - r;
#if defined(__AVX512F__)
    const NextPanels next = next_panels(w, in, panels, pair, end, b, blocks);
    if (blocks == 1) {
      row_block<G, G>(block, x + r * in, w, in, channels, panel, out + r * channels, next);
    } else {
      row_block<G, 1>(block, x + r * in, w, in, channels, panel, out + r * channels, next);
    }
#else
    // At AVX2 a tile takes one panel (ROW_BLOCK says why), and no next pair is asked for: with tiles of 3 rows by 2
    // panels that made fp32 forwards of 8-16 rows 9-29% slower (in the results NextPanels cites).
    for (int g = 0; g < G; ++g) {
      row_block<1, 0>(block, x + r * in, w, in, channels, panel + g, out + r * channels, NextPanels{});
    }
#endif
  }
}

// Every row of x times the panels of pairs [begin, end) of w's `panels` (pair p: panels 2p and 2p + 1, or 2p alone when
// it is the last): the unit of work of the callers' threads.
inline void panel_pairs(int64_t rows, const float* x, const float* w, int64_t in, int64_t channels, int64_t panels,
                        int64_t begin, int64_t end, float* out) {
  for (int64_t pair = begin; pair < end; ++pair) {
    if (pair * 2 + 2 <= panels) {
      panel_group<2>(rows, x, w, in, channels, panels, pair, end, out);
    } else {
      panel_group<1>(rows, x, w, in, channels, panels, pair, end, out);
    }
  }
}

}  // namespace specdecode
