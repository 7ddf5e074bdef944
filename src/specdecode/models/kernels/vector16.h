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
#else
#define SPECDECODE_SHUFFLE(v, ...) __builtin_shuffle(v, v16i{__VA_ARGS__})
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

}  // namespace specdecode
