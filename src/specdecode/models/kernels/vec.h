// The machine's own vector of floats and the few operations on it the kernels share (panel_tile.h, chunk_attention.cpp,
// layer_ops.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specdecode {

// The machine's own vector of floats: 16 lanes (one register) at AVX-512, 8 (one register) elsewhere; GCC keeps these
// in registers (a 64-byte type at AVX2 it lowers through the stack).
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#else
typedef float vec __attribute__((vector_size(32)));
#endif
constexpr int LANES = sizeof(vec) / sizeof(float);

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// x in every lane.  `vec{} + x` compiles to a scalar add and a shuffle before each use; this to one broadcast load where
// x is in memory (an add of 0 changes no product's bits here, since no sum the kernels start from +0 becomes -0).
inline vec broadcast(float x) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vec)_mm256_set1_ps(x);
#else
  return vec{} + x;
#endif
}

typedef int32_t veci __attribute__((vector_size(sizeof(vec))));
typedef uint32_t vecu __attribute__((vector_size(sizeof(vec))));
typedef uint16_t vech __attribute__((vector_size(sizeof(vec) / 2)));

// bf16 numbers (as their bits) to floats: a bf16 number is a float's upper half, so this is exact.
inline vec load(const uint16_t* p) {
  vech half;
  std::memcpy(&half, p, sizeof half);
  const vecu bits = __builtin_convertvector(half, vecu) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Floats to bf16 (their bits), rounded to nearest, ties to even, as torch's own conversion rounds; a NaN becomes a
// quiet NaN.
inline void store(uint16_t* p, vec v) {
  vecu bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vecu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vecu nan = vecu{} + 0x7fc0u;
  const vech half = __builtin_convertvector(v == v ? rounded : nan, vech);
  std::memcpy(p, &half, sizeof half);
}

// e^x given n, x / ln2 rounded to an integer, lane by lane on float vectors V and int32 vectors VI of as many lanes:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6 (relative error under 2e-7 there), times 2^n
// built in the exponent bits.  Every lane is computed alike, so a number's result does not depend on its lane.
template <typename V, typename VI>
inline V exp_split(V x, VI n) {
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  V p = r * (1.f / 720.f) + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const VI bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// e^x lane by lane for any x (clamped to [-87, 88], where float's e^x is finite and normal).
inline vec exp_vec(vec x) {
  x = x < -87.0f ? vec{} - 87.0f : x;
  x = x > 88.0f ? vec{} + 88.0f : x;
  const vec shifted = x * 1.44269504088896341f + (x < 0.f ? vec{} - 0.5f : vec{} + 0.5f);
  return exp_split(x, __builtin_convertvector(shifted, veci));  // truncation of n +- 0.5: n rounded
}

}  // namespace specdecode
