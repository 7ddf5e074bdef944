// The panel product's tile (panel_linear.cpp), shared with the prompt chunk's attention (chunk_attention.cpp), whose
// scores are the same product with the keys packed as panels.
#pragma once

#include <cstdint>

#include "vec.h"

namespace specdecode {

// Most rows a tile takes.  Rows are cut into blocks as even as possible (bf16_panel_tile.h says why).
#if defined(__AVX512F__)
constexpr int ROW_BLOCK = 12;  // 12 rows x 2 panels: 24 of the 32 vector registers hold sums
#else
constexpr int ROW_BLOCK = 3;  // 3 rows x 2 panels of two registers: 12 of the 16 hold sums
#endif
constexpr int PARTS = 16 / LANES;  // vectors of a panel's 16 channels
constexpr int64_t PREFETCH_STEPS = 32;  // steps (64-byte lines) ahead of each panel's stream

// Rows [0, R) of x times panels [panel, panel + G) of w into out (row stride `channels`).
template <int R, int G>
inline void tile(const float* x, const float* w, int64_t in, int64_t channels, int64_t panel, float* out) {
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
    for (int r = 0; r < R; ++r) {
      const vec input = vec{} + x[r * in + k];
      for (int j = 0; j < G * PARTS; ++j) sums[r][j] += input * weights[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < G * PARTS; ++j) store(out + r * channels + panel * 16 + j * LANES, sums[r][j]);
  }
}

template <int G>
void row_block(int64_t rows, const float* x, const float* w, int64_t in, int64_t channels, int64_t panel, float* out) {
  switch (rows) {
    case 1: tile<1, G>(x, w, in, channels, panel, out); break;
    case 2: tile<2, G>(x, w, in, channels, panel, out); break;
    case 3: tile<3, G>(x, w, in, channels, panel, out); break;
#if defined(__AVX512F__)
    case 4: tile<4, G>(x, w, in, channels, panel, out); break;
    case 5: tile<5, G>(x, w, in, channels, panel, out); break;
    case 6: tile<6, G>(x, w, in, channels, panel, out); break;
    case 7: tile<7, G>(x, w, in, channels, panel, out); break;
    case 8: tile<8, G>(x, w, in, channels, panel, out); break;
    case 9: tile<9, G>(x, w, in, channels, panel, out); break;
    case 10: tile<10, G>(x, w, in, channels, panel, out); break;
    case 11: tile<11, G>(x, w, in, channels, panel, out); break;
    case 12: tile<12, G>(x, w, in, channels, panel, out); break;
#endif
    default: break;
  }
}

// Every row of x times panels [panel, panel + G): blocks of at most ROW_BLOCK rows, as even as possible, the panels'
// weights staying in the cache from one block to the next.
template <int G>
void panel_group(int64_t rows, const float* x, const float* w, int64_t in, int64_t channels, int64_t panel,
                 float* out) {
  const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r = b * rows / blocks, block = (b + 1) * rows / blocks - r;
    row_block<G>(block, x + r * in, w, in, channels, panel, out + r * channels);
  }
}

// Every row of x times the panels of pairs [begin, end) of w's `panels` (pair p: panels 2p and 2p + 1, or 2p alone when
// it is the last): the unit of work of the callers' threads.
inline void panel_pairs(int64_t rows, const float* x, const float* w, int64_t in, int64_t channels, int64_t panels,
                        int64_t begin, int64_t end, float* out) {
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t panel = pair * 2;
    if (panel + 2 <= panels) {
      panel_group<2>(rows, x, w, in, channels, panel, out);
    } else {
      panel_group<1>(rows, x, w, in, channels, panel, out);
    }
  }
}

}  // namespace specdecode
