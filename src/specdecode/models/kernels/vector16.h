// 16 floats as one value, and the few operations on it the attention kernel uses (ragged_attention.cpp).
//
// At AVX-512 a 16-float value is one register: GCC's vector type of 64 bytes.  At AVX2 GCC lowers that type through
// the stack rather than as two registers (the attention kernel of 16 rows at 300 cached positions took 12x its
// arithmetic's time there), so below AVX-512 it is a pair of 8-float vectors, lanes 0-7 and 8-15, each operation done
// on both halves.  Every function here computes the same numbers in either form: lane by lane alike, and the sums of
// lanes in the same pairs and order.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "vec.h"

#if defined(__FMA__)
#include <immintrin.h>
#endif

namespace specdecode {

// v's lanes in the order given (__builtin_shufflevector from GCC 12 and in Clang; __builtin_shuffle before, which
// takes the order as a vector of the lanes' own width).
#if defined(__clang__) || __GNUC__ >= 12
#define SPECDECODE_SHUFFLE(index, v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SPECDECODE_SHUFFLE2(index, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SPECDECODE_SHUFFLE(index, v, ...) __builtin_shuffle(v, index{__VA_ARGS__})
#define SPECDECODE_SHUFFLE2(index, a, b, ...) __builtin_shuffle(a, b, index{__VA_ARGS__})
#endif

// e^x for x <= 0 (a score minus the row's largest), lane by lane, on a vector type V of floats and VI of as many
// int32: libm's expf is a call per number, and on a decoding step it took most of the kernel's time.
template <typename V, typename VI>
inline V exp_nonpositive(V x) {
  const V floor_x = x < -87.0f ? V{} - 87.0f : x;  // e^-87 is about float's smallest normal; below, 0 is as good
  // n = round(x / ln2): x <= 0, so -x / ln2 + 0.5 > 0, and truncating it rounds.
  return exp_split(floor_x, -__builtin_convertvector(0.5f - floor_x * 1.44269504088896341f, VI));
}

#if defined(__AVX512F__)

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 splat(float x) { return broadcast(x); }  // vec.h's: v16 is vec here

// v16 is vec here: vec.h's loads.
inline v16 load16(const float* p) { return load(p); }
inline v16 load16(const c10::BFloat16* p) { return load(reinterpret_cast<const uint16_t*>(p)); }

// a * b + c, one rounding where the CPU fuses them (the compiler contracts the two here as it always has).
inline v16 mul_add(v16 a, v16 b, v16 c) { return a * b + c; }
inline v16 mul_add(float a, v16 b, v16 c) { return a * b + c; }

inline v16 maximum(v16 a, v16 b) { return a > b ? a : b; }

// v's first `count` lanes, the others zero.
inline v16 first_lanes(v16 v, int32_t count) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return lane < count ? v : v16{};
}

inline v16 exp16(v16 x) { return exp_nonpositive<v16, v16i>(x); }

// Keeps v as computed: the compiler may not fuse its rounding into a later multiply-add.
inline void keep_rounded(v16& v) { __asm__("" : "+v"(v)); }

// The 16 lanes summed pairwise (halves, then quarters, ...): a fixed order that stays in registers.
inline float sum16(v16 v) {
  v += SPECDECODE_SHUFFLE(v16i, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += SPECDECODE_SHUFFLE(v16i, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += SPECDECODE_SHUFFLE(v16i, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += SPECDECODE_SHUFFLE(v16i, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}

// Lane c of the result is sum16(v[c]), bit for bit: the same pairs added in the same order (lanes c and c + 8, then
// + 4, + 2, + 1), but sixteen vectors' sums at once, each stage adding two vectors' halves side by side (45 shuffles
// and adds for sixteen sums, where sum16 takes eight operations for one).
__attribute__((always_inline)) inline v16 sums16(const v16 (&v)[16]) {
  v16 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s halves added; lanes 8-15: v[2i + 1]'s
    const v16 a = v[2 * i], b = v[2 * i + 1];
    halves[i] = SPECDECODE_SHUFFLE2(v16i, a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                SPECDECODE_SHUFFLE2(v16i, a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // four lanes each of v[4i], v[4i + 1], v[4i + 2], v[4i + 3]
    const v16 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = SPECDECODE_SHUFFLE2(v16i, a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  SPECDECODE_SHUFFLE2(v16i, a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // two lanes each of v[8i + 0, 4, 1, 5, 2, 6, 3, 7]
    const v16 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = SPECDECODE_SHUFFLE2(v16i, a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                 SPECDECODE_SHUFFLE2(v16i, a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return SPECDECODE_SHUFFLE2(v16i, eighths[0], eighths[1], 0, 4, 8, 12, 2, 6, 10, 14, 16, 20, 24, 28, 18, 22, 26, 30) +
         SPECDECODE_SHUFFLE2(v16i, eighths[0], eighths[1], 1, 5, 9, 13, 3, 7, 11, 15, 17, 21, 25, 29, 19, 23, 27, 31);
}

#else  // below AVX-512: two 8-float halves

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

struct v16 {
  v8 lo, hi;  // lanes 0-7, 8-15
  float operator[](int lane) const { return lane < 8 ? lo[lane] : hi[lane - 8]; }
};

inline v16 operator+(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator-(v16 a, float x) { return {a.lo - x, a.hi - x}; }
inline v16 operator*(v16 a, float x) { return {a.lo * x, a.hi * x}; }
inline v16& operator+=(v16& a, v16 b) { return a = a + b; }

inline v16 splat(float x) { return {broadcast(x), broadcast(x)}; }  // vec.h's: v8 is vec here

// vec is 8 floats here: vec.h's loads, a half each.
inline v16 load16(const float* p) { return {load(p), load(p + 8)}; }
inline v16 load16(const c10::BFloat16* p) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(p);
  return {load(bits), load(bits + 8)};
}

// a * b + c with one rounding where the CPU has FMA, written out: whether the compiler would contract the two
// operations on a pair of halves depends on how it keeps them (in registers or on the stack), and a row's sums must not
// depend on that.
inline v8 mul_add(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline v16 mul_add(v16 a, v16 b, v16 c) { return {mul_add(a.lo, b.lo, c.lo), mul_add(a.hi, b.hi, c.hi)}; }
inline v16 mul_add(float a, v16 b, v16 c) { return {mul_add(v8{} + a, b.lo, c.lo), mul_add(v8{} + a, b.hi, c.hi)}; }

inline v16 maximum(v16 a, v16 b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }

inline v16 first_lanes(v16 v, int32_t count) {
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return {lane < count ? v.lo : v8{}, lane + 8 < count ? v.hi : v8{}};
}

inline v16 exp16(v16 x) { return {exp_nonpositive<v8, v8i>(x.lo), exp_nonpositive<v8, v8i>(x.hi)}; }

inline void keep_rounded(v16& v) {
#if defined(__AVX__)
  __asm__("" : "+x"(v.lo), "+x"(v.hi));
#else
  __asm__("" : "+m"(v));  // no register holds 8 floats
#endif
}

// sum16 of the 16-lane form, pair for pair: lanes c and c + 8 (the halves added), then + 4, + 2, + 1.
inline float sum16(v16 v) {
  v8 h = v.lo + v.hi;
  h += SPECDECODE_SHUFFLE(v8i, h, 4, 5, 6, 7, 0, 1, 2, 3);
  h += SPECDECODE_SHUFFLE(v8i, h, 2, 3, 0, 1, 2, 3, 0, 1);
  h += SPECDECODE_SHUFFLE(v8i, h, 1, 0, 1, 0, 1, 0, 1, 0);
  return h[0];
}

// Lane c of the result is sum16(v[c]), bit for bit, sixteen vectors at once: each vector's halves added, then two
// vectors' quarters side by side, four vectors' eighths, eight vectors' last pairs, whose sums come out in order.
__attribute__((always_inline)) inline v16 sums16(const v16 (&v)[16]) {
  v8 halves[16], quarters[8], eighths[4], sums[2];
  for (int i = 0; i < 16; ++i) halves[i] = v[i].lo + v[i].hi;
  for (int i = 0; i < 8; ++i) {  // lanes 0-3: v[2i]'s lanes c + (c + 4); lanes 4-7: v[2i + 1]'s
    const v8 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = SPECDECODE_SHUFFLE2(v8i, a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                  SPECDECODE_SHUFFLE2(v8i, a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {  // two lanes each of v[4i], ..., v[4i + 3]: c + (c + 2)
    const v8 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = SPECDECODE_SHUFFLE2(v8i, a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
                 SPECDECODE_SHUFFLE2(v8i, a, b, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {  // v[8i], ..., v[8i + 7]: lane 0 + lane 1
    const v8 a = eighths[2 * i], b = eighths[2 * i + 1];
    sums[i] = SPECDECODE_SHUFFLE2(v8i, a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
              SPECDECODE_SHUFFLE2(v8i, a, b, 1, 3, 5, 7, 9, 11, 13, 15);
  }
  return {sums[0], sums[1]};
}

#endif

}  // namespace specdecode
