// 16 floats as one value, and the few operations on it the attention kernel uses (ragged_attention.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace specdecode {

// 16 floats as one value (GCC's and Clang's vector extensions: one AVX-512 register).  At AVX2 GCC lowers this type
// through the stack rather than as two registers, which makes the attention kernel slow there (panel_linear.cpp uses
// the machine's own width for that reason).  The sizes the kernels loop over are whole multiples of 16 (the Python
// side checks).
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// v's lanes in the order given (__builtin_shufflevector from GCC 12 and in Clang; __builtin_shuffle before).
#if defined(__clang__) || __GNUC__ >= 12
#define SPECDECODE_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SPECDECODE_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SPECDECODE_SHUFFLE(v, ...) __builtin_shuffle(v, v16i{__VA_ARGS__})
#define SPECDECODE_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, v16i{__VA_ARGS__})
#endif

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16 load16(const c10::BFloat16* p) {  // bfloat16 is a float's upper half
  v16h half;
  std::memcpy(&half, p, sizeof half);
  const v16u bits = __builtin_convertvector(half, v16u) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// The 16 lanes summed pairwise (halves, then quarters, ...): a fixed order that stays in registers.
inline float sum16(v16 v) {
  v += SPECDECODE_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += SPECDECODE_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += SPECDECODE_SHUFFLE(v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += SPECDECODE_SHUFFLE(v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}

// Lane c of the result is sum16(v[c]), bit for bit: the same pairs added in the same order (lanes c and c + 8, then
// + 4, + 2, + 1), but sixteen vectors' sums at once, each stage adding two vectors' halves side by side (45 shuffles
// and adds for sixteen sums, where sum16 takes eight operations for one).
__attribute__((always_inline)) inline v16 sums16(const v16 (&v)[16]) {
  v16 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s halves added; lanes 8-15: v[2i + 1]'s
    const v16 a = v[2 * i], b = v[2 * i + 1];
    halves[i] = SPECDECODE_SHUFFLE2(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                SPECDECODE_SHUFFLE2(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // four lanes each of v[4i], v[4i + 1], v[4i + 2], v[4i + 3]
    const v16 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = SPECDECODE_SHUFFLE2(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  SPECDECODE_SHUFFLE2(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // two lanes each of v[8i + 0, 4, 1, 5, 2, 6, 3, 7]
    const v16 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = SPECDECODE_SHUFFLE2(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                 SPECDECODE_SHUFFLE2(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return SPECDECODE_SHUFFLE2(eighths[0], eighths[1], 0, 4, 8, 12, 2, 6, 10, 14, 16, 20, 24, 28, 18, 22, 26, 30) +
         SPECDECODE_SHUFFLE2(eighths[0], eighths[1], 1, 5, 9, 13, 3, 7, 11, 15, 17, 21, 25, 29, 19, 23, 27, 31);
}

}  // namespace specdecode
