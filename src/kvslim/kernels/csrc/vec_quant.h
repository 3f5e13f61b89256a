// Code loaders for kvslim's quantized decode kernel (quant_decode.cpp): W codes -> W fp32 lanes, per ISA.
//
// Extends the float traits of vec_slim.h (VecScalar / VecAVX2 / VecAVX512: load, fma, exp, hsum4, ...) with
//   i8(p)      W signed int8 codes                     -> W floats
//   u8(p)      W unsigned int8 codes                   -> W floats
//   i4(p, lo, hi) W bytes of packed nibbles (element 2i in the low nibble of byte i, SPEC §1) -> 2W floats in
//              natural element order: lo = elements [0, W), hi = elements [W, 2W); `sign` sign-extends the nibble
//              (two's complement, symmetric codes) or not (unsigned, asymmetric codes).
//   f16(p)     W IEEE half-precision values -> W floats (AVX2: F16C)
//   i4p(p, ev, od) W bytes of packed nibbles -> 2W floats in *chunk order*: ev = elements 0, 2, ..., 2W-2 (low
//              nibbles), od = elements 1, 3, ..., 2W-1 (high nibbles). Cheaper than i4 (no byte interleave); the
//              kernel permutes the query (scores) and its accumulator (values) to match once per task.
// Each struct is compiled for its own target (`#pragma GCC target`), like vec_slim.h.
#pragma once

#include <cstring>

#include "vec_slim.h"

namespace kvslim_vec {

struct QuantScalar : VecScalar {
  static inline R f16(const uint16_t* p) {  // IEEE binary16 -> binary32, subnormals and inf/nan included
    const uint32_t h = *p, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
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
  static inline R i8(const int8_t* p) { return static_cast<float>(*p); }
  static inline R u8(const uint8_t* p) { return static_cast<float>(*p); }
  template <bool sign>
  static inline void i4(const uint8_t* p, R& lo, R& hi) {
    const int b = *p;
    if (sign) {
      lo = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(b << 4)) >> 4);
      hi = static_cast<float>(static_cast<int8_t>(b) >> 4);
    } else {
      lo = static_cast<float>(b & 0xF);
      hi = static_cast<float>(b >> 4);
    }
  }
  template <bool sign>
  static inline void i4p(const uint8_t* p, R& ev, R& od) { i4<sign>(p, ev, od); }  // one lane: chunk order = order
};

}  // namespace kvslim_vec

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvslim_vec {

struct QuantAVX2 : VecAVX2 {
  static inline R f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline R i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static inline R u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  template <bool sign>
  static inline void i4(const uint8_t* p, R& lo, R& hi) {
    // 8 bytes -> 16 nibbles; interleave low/high nibbles byte-wise first, then widen 8 + 8
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    __m128i e = _mm_unpacklo_epi8(l, h);  // 16 nibbles in element order
    if (sign) e = _mm_sub_epi8(_mm_xor_si128(e, _mm_set1_epi8(8)), _mm_set1_epi8(8));
    if (sign) {
      lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e));
      hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e, 8)));
    } else {
      lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e));
      hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e, 8)));
    }
  }
  template <bool sign>
  static inline void i4p(const uint8_t* p, R& ev, R& od) {
    // 8 bytes widened to 8 dwords straight from memory; low nibble = even element, high nibble = odd element
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if (sign) {
      const __m256i x = _mm256_cvtepi8_epi32(b);
      ev = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28));
      od = _mm256_cvtepi32_ps(_mm256_srai_epi32(x, 4));
    } else {
      const __m256i x = _mm256_cvtepu8_epi32(b);
      ev = _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xF)));
      od = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
    }
  }
};

}  // namespace kvslim_vec
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace kvslim_vec {

struct QuantAVX512 : VecAVX512 {
  static inline R f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline R i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static inline R u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  template <bool sign>
  static inline void i4(const uint8_t* p, R& lo, R& hi) {
    // 16 bytes -> 32 nibbles in element order (byte interleave of low and high nibbles), widened 16 + 16
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    __m128i e0 = _mm_unpacklo_epi8(l, h), e1 = _mm_unpackhi_epi8(l, h);
    if (sign) {
      const __m128i eight = _mm_set1_epi8(8);
      e0 = _mm_sub_epi8(_mm_xor_si128(e0, eight), eight);
      e1 = _mm_sub_epi8(_mm_xor_si128(e1, eight), eight);
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e0));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e1));
    } else {
      lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e0));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e1));
    }
  }
  template <bool sign>
  static inline void i4p(const uint8_t* p, R& ev, R& od) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (sign) {
      const __m512i x = _mm512_cvtepi8_epi32(b);
      ev = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 28), 28));
      od = _mm512_cvtepi32_ps(_mm512_srai_epi32(x, 4));
    } else {
      const __m512i x = _mm512_cvtepu8_epi32(b);
      ev = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xF)));
      od = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
    }
  }
};

}  // namespace kvslim_vec
#pragma GCC pop_options
