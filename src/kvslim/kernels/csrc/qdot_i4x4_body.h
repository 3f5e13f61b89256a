// i4x4 of the integer score path (vec_quant.h), included inside each QDot struct that defines
//   static __m256i pair_dot(lo, e, hi, o)   Σ over each 32-bit lane of lo·e + hi·o (u8 codes × s8 query), exact
// (AVX2: maddubs + madd; AVX-512 VNNI: two vpdpbusd). No include guard: one copy per struct.
  template <int HC, bool SIGNED>
  static inline void i4x4(const uint8_t* const* cr, int64_t i0, int64_t i1, const int8_t* const* qe,
                          const int8_t* const* qo, const float* const* dx, F4* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[HC];
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) acc[j] = _mm256_setzero_ps();
    // per 64-channel chunk (32 bytes: low nibbles = even channels, high = odd): per head [4 tokens × 2 blocks]
    // block-scaled sums
    for (int64_t i = i0; i < i1; i += 64) {
      const int64_t p = i / 2;
      __m256i lo[4], hi[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr[k] + p));
        if (SIGNED) x = _mm256_xor_si256(x, _mm256_set1_epi8(static_cast<char>(0x88)));
        lo[k] = _mm256_and_si256(x, m4);
        hi[k] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
      }
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) {
        const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qe[j] + p));
        const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo[j] + p));
        __m256i s[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) s[k] = pair_dot(lo[k], e, hi[k], o);
        acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_cvtepi32_ps(reduce4(s[0], s[1], s[2], s[3])),
                                                     _mm256_loadu_ps(dx[j] + i / 8)));
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) out[j] = half_sum(acc[j]);
  }
  // i4x4 for one 64-channel row (head dim 64) with the HC heads' query bytes (e, o) and block scales (dx) already in
  // registers: the caller loads them once per token group instead of once per 4 tokens. The same integer sums and
  // float operations as i4x4 over [0, 64): the same results.
  template <int HC, bool SIGNED>
  static inline void i4x4_64(const uint8_t* const* cr, const __m256i* e, const __m256i* o, const __m256* dx, F4* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo[4], hi[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr[k]));
      if (SIGNED) x = _mm256_xor_si256(x, _mm256_set1_epi8(static_cast<char>(0x88)));
      lo[k] = _mm256_and_si256(x, m4);
      hi[k] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
    }
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) {
      __m256i s[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) s[k] = pair_dot(lo[k], e[j], hi[k], o[j]);
      out[j] = half_sum(_mm256_add_ps(_mm256_setzero_ps(),
                                      _mm256_mul_ps(_mm256_cvtepi32_ps(reduce4(s[0], s[1], s[2], s[3])), dx[j])));
    }
  }
