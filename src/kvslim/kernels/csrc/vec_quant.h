// Code loaders for kvslim's quantized decode kernel (quant_decode.cpp): W codes -> W fp32 lanes, per ISA.
//
// Extends the float traits of vec_slim.h (VecScalar / VecAVX2 / VecAVX512: load, fma, exp, hsum4, ...) with
//   i8(p)      W signed int8 codes                     -> W floats
//   u8(p)      W unsigned int8 codes                   -> W floats
//   i4(p, lo, hi) W bytes of packed nibbles (element 2i in the low nibble of byte i, SPEC §1) -> 2W floats in
//              natural element order: lo = elements [0, W), hi = elements [W, 2W); `sign` sign-extends the nibble
//              (two's complement, symmetric codes) or not (unsigned, asymmetric codes).
//   f16(p)     W IEEE half-precision values -> W floats (AVX2: F16C)
//   params16(p, sdt) W fp16 (sdt 1) or bf16 (sdt 2) parameters -> W floats (decode_task_body.h params_f32)
//   i4p(p, ev, od) W bytes of packed nibbles -> 2W floats in *chunk order*: ev = elements 0, 2, ..., 2W-2 (low
//              nibbles), od = elements 1, 3, ..., 2W-1 (high nibbles). Cheaper than i4 (no byte interleave); the
//              kernel permutes the query (scores) and its accumulator (values) to match once per task.
// Each struct is compiled for its own target (`#pragma GCC target`), like vec_slim.h.
//
// Integer dot products (the kernel's int8-query score path, llama.cpp's q8_0 technique): QDotScalar / QDotAVX2
// (the AVX-512 build uses QDotAVX2) / QDotVNNI (AVX-512 VNNI: vpdpbusd, the same integer sums) give the scores of 4 tokens for HC query heads quantized to int8 per block of
// 32 channels (`qprep`: d_b = max|u_b| / 127, u8_i = round-half-even(u_i / d_b), |u8| ≤ 127):
//   i4x4  int4 codes (packed nibbles, SPEC §1 order; `SIGNED` two's-complement nibbles are read as c + 8 and the
//         caller subtracts 8·Σu8), channels [i0, i1) a multiple of 64: out[j][r] = Σ_b d_b Σ_{i∈b} u8_i · c_{r,i}
//   i8x4  signed int8 codes (sign trick: |c| · sign(c)·u8 with maddubs), channels a multiple of 32
// Products are exact in int16/int32 (|pair sum| ≤ 2·128·127); one float multiply-add per 32-channel block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "decode_common.h"  // prefetch_span, kPrefetchRows
#include "vec_slim.h"

namespace kvslim_vec {

struct QuantScalar : VecScalar {
  static inline R f16(const uint16_t* p) { return half_to_f32(*p); }  // subnormals and inf/nan included
  static inline R params16(const uint16_t* p, int sdt) { return sdt == 1 ? f16(p) : load(p); }
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

// 4 floats (the scores of 4 tokens) as a GCC vector, the same type in every ISA build
typedef float F4 __attribute__((vector_size(16)));

// query side of the integer path, shared by every ISA: u (n floats, n a multiple of 32) -> int8 codes q8 (natural
// order) and per-32 block scales d[n/32]; also the even / odd split the int4 kernels read (qe[p] = q8[2p],
// qo[p] = q8[2p+1]) and the block code sums bs[n/32] (for signed int4's +8 offset). Round half to even (the
// default FP rounding mode, as torch.round).
// dx (n/8 floats, n a multiple of 64: per 64-channel chunk 4 × d_2c then 4 × d_2c+1, the lanes of QDotAVX2::i4x4)
// and bs may be nullptr (not needed).
inline void qprep(const float* u, int64_t n, int8_t* q8, int8_t* qe, int8_t* qo, float* d, float* dx, int32_t* bs) {
  for (int64_t b = 0; b < n / 32; ++b) {
    float amax = 0.f;
    for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(u[b * 32 + i]));
    const float db = amax / 127.f;
    d[b] = db;
    int32_t sum = 0;
    for (int64_t i = 0; i < 32; ++i) {
      const int32_t c = db > 0.f ? static_cast<int32_t>(std::nearbyint(u[b * 32 + i] / db)) : 0;
      q8[b * 32 + i] = static_cast<int8_t>(c);
      sum += c;
    }
    if (bs) bs[b] = sum;
    if (dx)
      for (int i = 0; i < 4; ++i) dx[(b / 2) * 8 + (b % 2) * 4 + i] = db;
  }
  for (int64_t p = 0; p < n / 2; ++p) {
    qe[p] = q8[2 * p];
    qo[p] = q8[2 * p + 1];
  }
}

// value side of the integer path: weights w (n ≤ 16 floats, ≥ 0) of one 16-token sub-block -> uint8 codes
// wq[t] = round-half-even(w_t / dw), dw = max w / 127 (returned); wq[t] = 0 for t in [n, 16)
inline float wprep(const float* w, int64_t n, uint8_t* wq) {
  float amax = 0.f;
  for (int64_t t = 0; t < n; ++t) amax = std::max(amax, w[t]);
  const float dw = amax / 127.f;
  for (int64_t t = 0; t < 16; ++t)
    wq[t] = (t < n && dw > 0.f) ? static_cast<uint8_t>(std::nearbyint(w[t] / dw)) : 0;
  return dw;
}

// accumulator position of channel i (0 ≤ i < 64) in a 64-channel chunk of the integer value path (the lane order of
// QDotAVX2::i4_values: [even channels of bytes 0-7, 16-23 | odd of 0-7, 16-23 | even of 8-15, 24-31 | odd ...])
inline int64_t qv_pos(int64_t i) {
  const int64_t p = i / 2, odd = i % 2;
  const int64_t v = ((p % 16) >= 8 ? 2 : 0) + odd, k = (p >= 16 ? 8 : 0) + p % 8;
  return v * 16 + k;
}

struct QDotScalar {
  static constexpr bool kHasI4x4_64 = false;  // no i4x4_64 (quant_decode_body.h qscores_kivi64)
  static constexpr bool kHasScores16 = false;  // no scores16_64 / qprep64 / wprep16 (QDotVNNI)
  static constexpr int kQvHeads = 2;  // query heads per pass of the integer value path
  static inline int64_t qv_pos(int64_t i) { return kvslim_vec::qv_pos(i); }
  static inline float wprep(const float* w, int64_t n, uint8_t* wq) { return kvslim_vec::wprep(w, n, wq); }
  // acc[j][qv_pos(i)] += Σ_sb dw[j][sb] Σ_{t∈sb} wq[j][t] · code_t[i] for the 64 channels of the chunk at byte p0
  // of each row; tokens [0, m), rows base + t·rs (unsigned nibbles)
  template <int HC>
  static inline void i4_values(const uint8_t* base, int64_t rs, int64_t m, int64_t p0, const uint8_t* const* wq,
                               const float* const* dw, float* const* acc) {
    for (int64_t sb = 0; sb * 16 < m; ++sb)
      for (int j = 0; j < HC; ++j) {
        int32_t s[64] = {};
        for (int64_t t = sb * 16; t < std::min<int64_t>(m, sb * 16 + 16); ++t)
          for (int64_t p = 0; p < 32; ++p) {
            const int x = base[t * rs + p0 + p];
            s[2 * p] += (x & 0xF) * wq[j][t];
            s[2 * p + 1] += (x >> 4) * wq[j][t];
          }
        for (int64_t i = 0; i < 64; ++i) acc[j][qv_pos(i)] += dw[j][sb] * static_cast<float>(s[i]);
      }
  }
  static inline void qprep(const float* u, int64_t n, int8_t* q8, int8_t* qe, int8_t* qo, float* d, float* dx,
                           int32_t* bs) {
    kvslim_vec::qprep(u, n, q8, qe, qo, d, dx, bs);
  }
  template <int HC, bool SIGNED>
  static inline void i4x4(const uint8_t* const* cr, int64_t i0, int64_t i1, const int8_t* const* qe,
                          const int8_t* const* qo, const float* const* dx, F4* out) {
    for (int j = 0; j < HC; ++j)
      for (int r = 0; r < 4; ++r) {
        float acc = 0.f;
        for (int64_t b = i0 / 32; b < i1 / 32; ++b) {
          int32_t s = 0;
          for (int64_t p = b * 16; p < b * 16 + 16; ++p) {
            const int x = cr[r][p] ^ (SIGNED ? 0x88 : 0);
            s += (x & 0xF) * qe[j][p] + (x >> 4) * qo[j][p];
          }
          acc += dx[j][(b / 2) * 8 + (b % 2) * 4] * static_cast<float>(s);
        }
        out[j][r] = acc;
      }
  }
  template <int HC>
  static inline void i8x4(const uint8_t* const* cr, int64_t i0, int64_t i1, const int8_t* const* q8,
                          const float* const* d, F4* out) {
    for (int j = 0; j < HC; ++j)
      for (int r = 0; r < 4; ++r) {
        float acc = 0.f;
        for (int64_t b = i0 / 32; b < i1 / 32; ++b) {
          int32_t s = 0;
          for (int64_t i = b * 32; i < b * 32 + 32; ++i) s += static_cast<int8_t>(cr[r][i]) * q8[j][i];
          acc += d[j][b] * static_cast<float>(s);
        }
        out[j][r] = acc;
      }
  }
};

}  // namespace kvslim_vec

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvslim_vec {

struct QuantAVX2 : VecAVX2 {
  static inline R f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline R params16(const uint16_t* p, int sdt) { return sdt == 1 ? f16(p) : load(p); }
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

struct QDotAVX2 {
  static constexpr bool kHasI4x4_64 = true;
  static constexpr bool kHasScores16 = false;
  static constexpr int kQvHeads = 2;
  static inline int64_t qv_pos(int64_t i) { return kvslim_vec::qv_pos(i); }
  static inline float wprep(const float* w, int64_t n, uint8_t* wq) {
    if (n < 16) return kvslim_vec::wprep(w, n, wq);
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    const float dw = VecAVX2::hmax(_mm256_max_ps(w0, w1)) / 127.f;
    __m128i b = _mm_setzero_si128();
    if (dw > 0.f) {
      const __m256 vd = _mm256_set1_ps(dw);
      const __m256i p = _mm256_permute4x64_epi64(
          _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_div_ps(w0, vd)), _mm256_cvtps_epi32(_mm256_div_ps(w1, vd))),
          0xD8);
      b = _mm_packus_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wq), b);
    return dw;
  }
  // pairs of tokens: bytes of rows t, t+1 interleaved, nibbles masked -> 4 × 16 (code_t, code_t+1) byte pairs;
  // maddubs with the pair of weights accumulates 16 tokens in int16 (≤ 8 · 2 · 15 · 127 < 2^15), then fp32. The
  // rows kPrefetchRows tokens ahead are fetched meanwhile (decode_common.h).
  template <int HC>
  static inline void i4_values(const uint8_t* base, int64_t rs, int64_t m, int64_t p0, const uint8_t* const* wq,
                               const float* const* dw, float* const* acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t sb = 0; sb * 16 < m; ++sb) {
      __m256i A[HC][4];
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) A[j][v] = _mm256_setzero_si256();
      const int64_t t1 = std::min<int64_t>(m, sb * 16 + 16);
      for (int64_t t = sb * 16; t < t1; t += 2) {
        kvslim_decode::prefetch_span(base + (t + kvslim_decode::kPrefetchRows) * rs + p0, 2 * rs);
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + t * rs + p0));
        const __m256i x1 = t + 1 < t1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (t + 1) * rs + p0))
                                      : _mm256_setzero_si256();  // never past the last token
        const __m256i u0 = _mm256_unpacklo_epi8(x0, x1), u1 = _mm256_unpackhi_epi8(x0, x1);
        const __m256i c[4] = {_mm256_and_si256(u0, m4), _mm256_and_si256(_mm256_srli_epi16(u0, 4), m4),
                              _mm256_and_si256(u1, m4), _mm256_and_si256(_mm256_srli_epi16(u1, 4), m4)};
#pragma GCC unroll 4
        for (int j = 0; j < HC; ++j) {
          int16_t pair;
          std::memcpy(&pair, wq[j] + t, 2);
          const __m256i w = _mm256_set1_epi16(pair);
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) A[j][v] = _mm256_add_epi16(A[j][v], _mm256_maddubs_epi16(c[v], w));
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) {
        const __m256 d = _mm256_set1_ps(dw[j][sb]);
        float* o = acc[j];
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(A[j][v])));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(A[j][v], 1)));
          _mm256_storeu_ps(o + v * 16, _mm256_fmadd_ps(lo, d, _mm256_loadu_ps(o + v * 16)));
          _mm256_storeu_ps(o + v * 16 + 8, _mm256_fmadd_ps(hi, d, _mm256_loadu_ps(o + v * 16 + 8)));
        }
      }
    }
  }
  // kvslim_vec::qprep with vectors (same IEEE division and round-half-even conversion: the same codes)
  static inline void qprep(const float* u, int64_t n, int8_t* q8, int8_t* qe, int8_t* qo, float* d, float* dx,
                           int32_t* bs) {
    const __m256 sgn = _mm256_set1_ps(-0.f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                        14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t b = 0; b < n / 32; ++b) {
      const float* x = u + b * 32;
      const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
                   v3 = _mm256_loadu_ps(x + 24);
      const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sgn, v0), _mm256_andnot_ps(sgn, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(sgn, v2), _mm256_andnot_ps(sgn, v3)));
      const float db = VecAVX2::hmax(m) / 127.f;
      d[b] = db;
      if (dx) _mm_storeu_ps(dx + (b / 2) * 8 + (b % 2) * 4, _mm_set1_ps(db));
      __m256i c = _mm256_setzero_si256();
      if (db > 0.f) {
        const __m256 vd = _mm256_set1_ps(db);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_div_ps(v0, vd)), i1 = _mm256_cvtps_epi32(_mm256_div_ps(v1, vd)),
                      i2 = _mm256_cvtps_epi32(_mm256_div_ps(v2, vd)), i3 = _mm256_cvtps_epi32(_mm256_div_ps(v3, vd));
        c = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)),
                                        perm);  // 32 int8 in natural order
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8 + b * 32), c);
      // even / odd bytes of each 16-byte lane, then [evens of lane 0, evens of lane 1 | odds 0, odds 1]
      const __m256i s = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(c, eo), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qe + b * 16), _mm256_castsi256_si128(s));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qo + b * 16), _mm256_extracti128_si256(s, 1));
      if (bs) {
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) sum += q8[b * 32 + i];
        bs[b] = sum;
      }
    }
  }
  // 4 rows of int32 partial sums (8 lanes each: lanes 0-3 one 32-channel block, 4-7 the next, or one block for
  // int8) -> one vector [row0..row3 | row0..row3] of per-128-bit-lane sums
  static inline __m256i reduce4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
  }
  static inline F4 half_sum(__m256 acc) {
    return F4(_mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)));
  }
  // Σ over each 32-bit lane of lo·e + hi·o (unsigned codes × signed query bytes), exact in int32
  static inline __m256i pair_dot(__m256i lo, __m256i e, __m256i hi, __m256i o) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o)),
                             _mm256_set1_epi16(1));
  }
#include "qdot_i4x4_body.h"
  template <int HC>
  static inline void i8x4(const uint8_t* const* cr, int64_t i0, int64_t i1, const int8_t* const* q8,
                          const float* const* d, F4* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[HC];
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = i0; i < i1; i += 32) {
      __m256i x[4], ax[4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr[r] + i));
        ax[r] = _mm256_sign_epi8(x[r], x[r]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8[j] + i));
        __m256i s[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r)
          s[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[r], _mm256_sign_epi8(qv, x[r])), ones);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce4(s[0], s[1], s[2], s[3])), _mm256_set1_ps(d[j][i / 32]),
                                 acc[j]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) out[j] = half_sum(acc[j]);
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
  static inline R params16(const uint16_t* p, int sdt) { return sdt == 1 ? f16(p) : load(p); }
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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace kvslim_vec {

// The integer paths with AVX-512 VNNI (vpdpbusd: u8 × s8 products summed 4 to a 32-bit lane, exact; 256-bit
// vectors for the scores, 512-bit for the values). Sums are the same integers as QDotAVX2's, converted and scaled
// the same way: the same results.
struct QDotVNNI : QDotAVX2 {
  static constexpr int kQvHeads = 3;
  static constexpr bool kHasScores16 = true;
  // wprep for 16 weights w = p ⊙ s (one 512-bit vector): the same codes (division, round-half-even; int32 -> uint8
  // saturation in one step equals the two packs for w ≥ 0) and the same dw
  static inline float wprep16(const float* p, const float* s, uint8_t* wq) {
    const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(s));
    const float dw = _mm512_reduce_max_ps(w) / 127.f;
    __m128i b = _mm_setzero_si128();
    if (dw > 0.f) b = _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(w, _mm512_set1_ps(dw))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wq), b);
    return dw;
  }
  // Scores of 16 tokens of head dim 64 (int4 KIVI keys: one 64-channel row of 32 bytes per token, rows r + t·rs)
  // for HC query heads, token t in lane t. The rows are transposed in registers (8 × 8 dwords per 256-bit half), so
  // that vector q holds bytes 4q .. 4q + 3 of all 16 rows; then one vpdpbusd per (q, nibble half) and head with the
  // query's 4 matching bytes broadcast: the sums come out per token, with no horizontal reduction. The same
  // integer sums as i4x4_64 and the same float operations per lane (the block products rounded apart, then added):
  // the same scores. qe / qo: the heads' even / odd query bytes (32 each, stride 32), d: block scales (2 per head),
  // corr: signed-int4 offsets (or 0), z: q·zero-points (ASYM), mask: 16 additive entries or nullptr;
  // out[j·ps + t] = (Σ + corr_j) + (mask_t + z_j).
  // qprep for one 64-channel row already in registers (u: channels 0-15, 16-31, 32-47, 48-63): the same codes, block
  // scales and even / odd bytes as qprep(u, 64, ...) (the same division and round-half-even conversion; saturation
  // int32 -> int8 in one step equals the two packs)
  static inline void qprep64(const __m512* u, int8_t* qe, int8_t* qo, float* d, float* dx) {
    const __m512 sgn = _mm512_set1_ps(-0.f);
    const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                        14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i s[2];
#pragma GCC unroll 2
    for (int b = 0; b < 2; ++b) {
      const __m512 v0 = u[2 * b], v1 = u[2 * b + 1];
      const float db = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sgn, v0), _mm512_andnot_ps(sgn, v1))) / 127.f;
      d[b] = db;
      _mm_storeu_ps(dx + 4 * b, _mm_set1_ps(db));
      __m256i c = _mm256_setzero_si256();
      if (db > 0.f) {
        const __m512 vd = _mm512_set1_ps(db);
        c = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(v0, vd)))),
            _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(v1, vd))), 1);
      }
      s[b] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(c, eo), 0xD8);  // [evens | odds] of the block
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qe), _mm256_permute2x128_si256(s[0], s[1], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qo), _mm256_permute2x128_si256(s[0], s[1], 0x31));
  }
  template <int HC, bool SIGNED, bool ASYM>
  static inline void scores16_64(const uint8_t* r, int64_t rs, const int8_t* qe, const int8_t* qo, const float* d,
                                 const float* corr, const float* z, const float* mask, float* out, int64_t ps) {
    kvslim_decode::prefetch_span(r + kvslim_decode::kPrefetchRows * rs, 16 * rs);
    auto row = [&](int t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + t * rs)); };
    // R[k] = [row a | row b] with (a, b) = (k, k + 4) for k < 4 and (k + 4, k + 8) for k ≥ 4: after the two
    // in-lane unpack stages and one 128-bit lane shuffle the tokens come out in order
    __m512i R[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const int a = k < 4 ? k : k + 4;
      R[k] = _mm512_inserti64x4(_mm512_castsi256_si512(row(a)), row(a + 4), 1);
    }
    __m512i T[8], A[8];
#pragma GCC unroll 2
    for (int s = 0; s < 2; ++s) {  // s = 0: rows of R0..R3, s = 1: of R4..R7
      const __m512i* q = R + 4 * s;
      T[4 * s] = _mm512_unpacklo_epi32(q[0], q[1]);
      T[4 * s + 1] = _mm512_unpackhi_epi32(q[0], q[1]);
      T[4 * s + 2] = _mm512_unpacklo_epi32(q[2], q[3]);
      T[4 * s + 3] = _mm512_unpackhi_epi32(q[2], q[3]);
      // A[4s + u]: dword u (lanes 0, 2) and u + 4 (lanes 1, 3) of the set's rows
      A[4 * s] = _mm512_unpacklo_epi64(T[4 * s], T[4 * s + 2]);
      A[4 * s + 1] = _mm512_unpackhi_epi64(T[4 * s], T[4 * s + 2]);
      A[4 * s + 2] = _mm512_unpacklo_epi64(T[4 * s + 1], T[4 * s + 3]);
      A[4 * s + 3] = _mm512_unpackhi_epi64(T[4 * s + 1], T[4 * s + 3]);
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i lo[8], hi[8];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      __m512i x[2] = {_mm512_shuffle_i32x4(A[u], A[4 + u], _MM_SHUFFLE(2, 0, 2, 0)),   // dword u of rows 0..15
                      _mm512_shuffle_i32x4(A[u], A[4 + u], _MM_SHUFFLE(3, 1, 3, 1))};  // dword u + 4
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        if (SIGNED) x[v] = _mm512_xor_si512(x[v], _mm512_set1_epi8(static_cast<char>(0x88)));
        lo[u + 4 * v] = _mm512_and_si512(x[v], m4);
        hi[u + 4 * v] = _mm512_and_si512(_mm512_srli_epi16(x[v], 4), m4);
      }
    }
    const __m512 mk = mask ? _mm512_loadu_ps(mask) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) {
      int32_t e4[8], o4[8];
      std::memcpy(e4, qe + 32 * j, 32);
      std::memcpy(o4, qo + 32 * j, 32);
      __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // 32-channel blocks 0 and 1
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        s[q / 4] = _mm512_dpbusd_epi32(s[q / 4], lo[q], _mm512_set1_epi32(e4[q]));
        s[q / 4] = _mm512_dpbusd_epi32(s[q / 4], hi[q], _mm512_set1_epi32(o4[q]));
      }
      __m512 p0 = _mm512_mul_ps(_mm512_cvtepi32_ps(s[0]), _mm512_set1_ps(d[2 * j]));
      __m512 p1 = _mm512_mul_ps(_mm512_cvtepi32_ps(s[1]), _mm512_set1_ps(d[2 * j + 1]));
      asm("" : "+v"(p0), "+v"(p1));  // each product rounded on its own, as in i4x4_64 (no fused multiply-add)
      const __m512 sv = _mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_set1_ps(corr[j]));
      const __m512 zz = ASYM ? _mm512_add_ps(mk, _mm512_set1_ps(z[j])) : mk;
      _mm512_storeu_ps(out + j * ps, _mm512_add_ps(_mm512_add_ps(sv, _mm512_setzero_ps()), zz));
    }
  }
  static inline __m256i pair_dot(__m256i lo, __m256i e, __m256i hi, __m256i o) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, e), hi, o);
  }
#include "qdot_i4x4_body.h"

  // accumulator position of channel i of a 64-channel chunk in i4_values below: 512-bit vector v = 2·(which
  // half y of the 4-token interleave) + (i odd), dword lane 4·L + k holding byte p = base[L] + 4·y + k of the row
  // (byte p = channels 2p, 2p + 1; base = {0, 16, 8, 24}: the 128-bit lanes after the two unpacks)
  static inline int64_t qv_pos(int64_t i) {
    static constexpr int64_t kLane[4] = {0, 2, 1, 3};  // L of p / 8
    const int64_t p = i / 2, y = (p % 8) / 4;
    return (2 * y + i % 2) * 16 + 4 * kLane[p / 8] + p % 4;
  }
  // 4 tokens at a time in 512-bit vectors: rows (0, 2) and (1, 3) side by side, bytes interleaved (unpack 8-bit,
  // realign the 128-bit lanes, unpack 16-bit) so that each dword lane holds one byte position of the 4 tokens in
  // token order; nibbles masked; one vpdpbusd with the 4 tokens' weights per 16 channels (int32, exact). Per head
  // 4 accumulators: 3 heads fit the register file with the temporaries.
  template <int HC>
  static inline void i4_values(const uint8_t* base, int64_t rs, int64_t m, int64_t p0, const uint8_t* const* wq,
                               const float* const* dw, float* const* acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t sb = 0; sb * 16 < m; ++sb) {
      __m512i A[HC][4];
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) A[j][v] = _mm512_setzero_si512();
      const int64_t t1 = std::min<int64_t>(m, sb * 16 + 16);
      for (int64_t t = sb * 16; t < t1; t += 4) {
        const uint8_t* r = base + t * rs + p0;
        kvslim_decode::prefetch_span(r + kvslim_decode::kPrefetchRows * rs, 4 * rs);
        __m256i x[4];
        if (t + 4 <= t1) {
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) x[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + k * rs));
        } else {  // never past the last token: masked loads read nothing for the missing rows
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) x[k] = _mm256_maskz_loadu_epi8(t + k < t1 ? ~0u : 0u, r + k * rs);
        }
        const __m512i X = _mm512_inserti64x4(_mm512_castsi256_si512(x[0]), x[2], 1);
        const __m512i Y = _mm512_inserti64x4(_mm512_castsi256_si512(x[1]), x[3], 1);
        const __m512i U = _mm512_unpacklo_epi8(X, Y), H = _mm512_unpackhi_epi8(X, Y);
        const __m512i P01 = _mm512_shuffle_i64x2(U, H, 0x44), P23 = _mm512_shuffle_i64x2(U, H, 0xEE);
        const __m512i y[2] = {_mm512_unpacklo_epi16(P01, P23), _mm512_unpackhi_epi16(P01, P23)};
        __m512i w[HC];
#pragma GCC unroll 4
        for (int j = 0; j < HC; ++j) {
          int32_t quad;  // weights of tokens t .. t + 3 (0 past the last one: wprep pads the sub-block)
          std::memcpy(&quad, wq[j] + t, 4);
          w[j] = _mm512_set1_epi32(quad);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i lo = _mm512_and_si512(y[h], m4), hi = _mm512_and_si512(_mm512_srli_epi16(y[h], 4), m4);
#pragma GCC unroll 4
          for (int j = 0; j < HC; ++j) {
            A[j][2 * h] = _mm512_dpbusd_epi32(A[j][2 * h], lo, w[j]);
            A[j][2 * h + 1] = _mm512_dpbusd_epi32(A[j][2 * h + 1], hi, w[j]);
          }
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) {
        const __m512 d = _mm512_set1_ps(dw[j][sb]);
        float* o = acc[j];
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
          _mm512_storeu_ps(o + v * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(A[j][v]), d, _mm512_loadu_ps(o + v * 16)));
      }
    }
  }
};

}  // namespace kvslim_vec
#pragma GCC pop_options
