// SIMD traits for kvslim's shared-rows attention kernels (slim decode, encoder-decoder cross-attention).
//
// Three instruction sets behind one small interface: AVX-512 (16 lanes), AVX2+FMA (8 lanes) and plain scalar
// code (1 lane). Each struct is compiled for its own target through `#pragma GCC target`, so the library builds
// without -march flags and the caller picks the path at run time (`__builtin_cpu_supports`). Rows may be fp32 or
// bf16 (`uint16_t` bit patterns, widened exactly to fp32 on load). `exp` is the Cephes polynomial (max relative
// error ~2e-7 on [-87, 88]) and returns exactly 0 below -87.3, like expf's underflow to 0 for masked scores.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvslim_vec {

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// IEEE binary16 -> binary32 (subnormals, inf, nan included): the scalar twin of F16C's vcvtph2ps
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {  // subnormal: m · 2^-24
    float f = static_cast<float>(m) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }

// Cephes expf constants
constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.3365447504f, kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

struct VecScalar {
  using R = float;
  static constexpr int W = 1;
  static inline R zero() { return 0.f; }
  static inline R set1(float x) { return x; }
  static inline R load(const float* p) { return *p; }
  static inline R load(const uint16_t* p) { return bf16_to_f32(*p); }
  static inline void store(float* p, R v) { *p = v; }
  static inline R fma(R a, R b, R c) { return a * b + c; }
  static inline R mul(R a, R b) { return a * b; }
  static inline R add(R a, R b) { return a + b; }
  static inline R sub(R a, R b) { return a - b; }
  static inline R max(R a, R b) { return a > b ? a : b; }
  static inline float hsum(R v) { return v; }
  static inline float hmax(R v) { return v; }
  static inline void hsum4(R a, R b, R c, R d, float* out) { out[0] = a; out[1] = b; out[2] = c; out[3] = d; }
  static inline R exp(R x) { return x < kExpLo ? 0.f : std::exp(x); }
};

}  // namespace kvslim_vec

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace kvslim_vec {

struct VecAVX2 {
  using R = __m256;
  static constexpr int W = 8;
  static inline R zero() { return _mm256_setzero_ps(); }
  static inline R set1(float x) { return _mm256_set1_ps(x); }
  static inline R load(const float* p) { return _mm256_loadu_ps(p); }
  static inline R load(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static inline R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static inline R max(R a, R b) { return _mm256_max_ps(a, b); }
  static inline float hsum(R v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline float hmax(R v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // out[i] = sum of the lanes of the i-th argument (a transpose-reduce: 3 hadds + 1 add for four sums)
  static inline void hsum4(R a, R b, R c, R d, float* out) {
    R t0 = _mm256_hadd_ps(a, b), t1 = _mm256_hadd_ps(c, d);
    R t2 = _mm256_hadd_ps(t0, t1);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
  }
  static inline R exp(R x) {
    const R under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_LT_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(kExpHi));
    x = _mm256_max_ps(x, _mm256_set1_ps(kExpLo));
    R fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kC1), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kC2), x);
    R y = _mm256_set1_ps(kP0);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
  }
};

}  // namespace kvslim_vec
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace kvslim_vec {

struct VecAVX512 {
  using R = __m512;
  static constexpr int W = 16;
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R set1(float x) { return _mm512_set1_ps(x); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline R load(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static inline R max(R a, R b) { return _mm512_max_ps(a, b); }
  static inline float hsum(R v) { return _mm512_reduce_add_ps(v); }
  static inline float hmax(R v) { return _mm512_reduce_max_ps(v); }
  static inline __m256 half_sum(R v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  }
  static inline void hsum4(R a, R b, R c, R d, float* out) { VecAVX2::hsum4(half_sum(a), half_sum(b),
                                                                             half_sum(c), half_sum(d), out); }
  static inline R exp(R x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLo), _CMP_LT_OQ);
    x = _mm512_min_ps(x, _mm512_set1_ps(kExpHi));
    x = _mm512_max_ps(x, _mm512_set1_ps(kExpLo));
    R fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kC1), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kC2), x);
    R y = _mm512_set1_ps(kP0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);
  }
};

}  // namespace kvslim_vec
#pragma GCC pop_options
