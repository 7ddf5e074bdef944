// 16 floats as one value, and the few operations on it both kernels share (ragged_attention.cpp, few_rows.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace specdecode {

// 16 floats as one value (GCC's and Clang's vector extensions: one AVX-512 register, two AVX2 ones, ...).  The
// sizes the kernels loop over are whole multiples of 16 (the Python side checks).
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

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
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}

}  // namespace specdecode
