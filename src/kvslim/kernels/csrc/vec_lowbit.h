// SIMD traits for kvslim's low-bit decode kernel (quant_decode_lowbit.cpp): 8-lane fp32 vectors and loaders of
// packed 2-bit / 3-bit codes, per instruction set.
//
// Every path works on *units* of 8 codes, in natural element order (lane j = code 8u + j):
//   3 bits: a unit is 3 bytes, code j at bits [3j, 3j+3) of the little-endian 24-bit word (ops/quant_formats.py);
//   2 bits: a unit is 2 bytes, code j at bits [2j, 2j+2) of the little-endian 16-bit word.
// `unit` returns lane j = c_j · 2^(BITS·j): the AVX2 loader broadcasts the word and masks each lane's field *in
// place* (no shift: one AND and one int->float conversion per 8 codes; the values are exact integers < 2^24). The
// kernel folds the lane factors 2^(−BITS·j) (`unscale`) into the query (scores) and undoes them on the value
// accumulator once per task, exactly (powers of two). A 4-byte load covers BITS bytes plus 4 − BITS after them,
// so the last unit of a row (`LAST`) loads the 4 bytes that *end* at its end and shifts them down: nothing past a
// row is ever read. The scalar traits
// (`LowScalar`) emulate the same 8-lane interface with plain arrays, for CPUs without AVX2 + FMA + F16C.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_slim.h"

namespace kvslim_lowbit {

// IEEE binary16 -> binary32 (kvslim_vec::half_to_f32; the name turbo_decode_body.h still uses)
inline float half_to_float(uint16_t h) { return kvslim_vec::half_to_f32(h); }

// one unit of 8 codes at p (exactly BITS bytes read): out[j] = c_j · 2^(BITS·j)
template <int BITS>
inline void unit_scalar(const uint8_t* p, float* out) {
  uint32_t w = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
  if (BITS == 3) w |= static_cast<uint32_t>(p[2]) << 16;
  for (int j = 0; j < 8; ++j) out[j] = static_cast<float>(w & (((1u << BITS) - 1) << (BITS * j)));
}

// lane j of a unit carries 2^(BITS·j) (SIGN = 1) or 2^(−BITS·j) (SIGN = −1)
template <int BITS, int SIGN>
inline float lane_factor(int j) {
  return std::ldexp(1.f, SIGN * BITS * j);
}

struct F8 {
  float v[8];
};

struct LowScalar {
  using R = F8;
  static constexpr int W = 8;
  static inline R zero() { return set1(0.f); }
  static inline R set1(float x) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = x;
    return r;
  }
  static inline R load(const float* p) {
    R r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static inline void store(float* p, const R& a) { std::memcpy(p, a.v, sizeof a.v); }
  static inline R fma(const R& a, const R& b, const R& c) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  static inline R mul(const R& a, const R& b) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  static inline R add(const R& a, const R& b) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] + b.v[i];
    return r;
  }
  static inline R sub(const R& a, const R& b) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] - b.v[i];
    return r;
  }
  static inline float hsum(const R& a) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += a.v[i];
    return s;
  }
  static inline R max(const R& a, const R& b) {  // b where a is NaN, as _mm256_max_ps(a, b)
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  static inline float hmax(const R& a) {
    float m = a.v[0];
    for (int i = 1; i < 8; ++i) m = a.v[i] > m ? a.v[i] : m;
    return m;
  }
  static inline void hsum4(const R& a, const R& b, const R& c, const R& d, float* out) {
    out[0] = hsum(a);
    out[1] = hsum(b);
    out[2] = hsum(c);
    out[3] = hsum(d);
  }
  static inline R exp(const R& a) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] < kvslim_vec::kExpLo ? 0.f : std::exp(a.v[i]);
    return r;
  }
  // 8 parameters (sdt 1: fp16, 2: bf16 bit patterns) -> fp32
  static inline R params16(const uint16_t* p, int sdt) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = sdt == 1 ? half_to_float(p[i]) : kvslim_vec::bf16_to_f32(p[i]);
    return r;
  }
  template <int BITS, bool LAST>
  static inline R unit(const uint8_t* p) {
    R r;
    unit_scalar<BITS>(p, r.v);
    return r;
  }
  template <int BITS, int SIGN>
  static inline R lanes() {
    R r;
    for (int j = 0; j < 8; ++j) r.v[j] = lane_factor<BITS, SIGN>(j);
    return r;
  }
  // p·s where p != 0, else 0 (a zero weight never lets its token's parameters, which may be NaN, through)
  static inline R mul_nz(const R& p, const R& s) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = p.v[i] == 0.f ? 0.f : p.v[i] * s.v[i];
    return r;
  }
};

}  // namespace kvslim_lowbit

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvslim_lowbit {

struct LowAVX2 : kvslim_vec::VecAVX2 {
  static inline R params16(const uint16_t* p, int sdt) {
    return sdt == 1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))) : load(p);
  }
  // 8 codes of the unit at p -> lane j = c_j · 2^(BITS·j); LAST: the unit ends its row (load the 4 bytes
  // ending there, shift them down)
  template <int BITS, bool LAST>
  static inline R unit(const uint8_t* p) {
    int32_t w;
    std::memcpy(&w, LAST ? p - (4 - BITS) : p, 4);
    __m256i x = _mm256_set1_epi32(w);
    if (LAST) x = _mm256_srli_epi32(x, 8 * (4 - BITS));
    constexpr int m = (1 << BITS) - 1;
    const __m256i mask = _mm256_setr_epi32(m, m << BITS, m << 2 * BITS, m << 3 * BITS, m << 4 * BITS, m << 5 * BITS,
                                           m << 6 * BITS, m << 7 * BITS);
    return _mm256_cvtepi32_ps(_mm256_and_si256(x, mask));
  }
  template <int BITS, int SIGN>
  static inline R lanes() {
    alignas(32) float f[8];
    for (int j = 0; j < 8; ++j) f[j] = lane_factor<BITS, SIGN>(j);
    return _mm256_load_ps(f);
  }
  static inline R mul_nz(R p, R s) {
    return _mm256_and_ps(_mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_NEQ_UQ), _mm256_mul_ps(p, s));
  }
};

}  // namespace kvslim_lowbit
#pragma GCC pop_options
