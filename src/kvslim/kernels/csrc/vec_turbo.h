// SIMD traits for kvslim's turbo decode op (turbo_decode.cpp): the 8-lane fp32 vectors of vec_lowbit.h plus a
// codebook lookup of packed turbo codes, per instruction set.
//
// A *unit* is 8 codes of BITS bits in BITS bytes (kvslim's packing: code j at bits [BITS·j, BITS·j + BITS) of the
// little-endian word; 2, 3 or 4 bits). `lut` returns lane j = table[c_j]: the AVX2 loader broadcasts the word,
// shifts each lane's field down (srlv) and permutes the (up to 8-entry) level table by it, unmasked: vpermps reads
// only bits [2:0] of an index, so 3-bit codes need no mask, 2-bit codes look up a table whose lanes 4-7 repeat
// lanes 0-3 (`table<2>`), and 4-bit codes permute two halves and blend on bit 3 (shifted to the sign; the bits above
// it shift out). A 4-byte load covers BITS bytes and 4 − BITS after them, so the unit that
// ends a row (`LAST`) loads the 4 bytes ending there and shifts them down: nothing past a row is read. The scalar
// traits (`TurboScalar`) give the same 8-lane interface with plain arrays (the reference path, and CPUs without
// AVX2 + FMA + F16C).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec_lowbit.h"

namespace kvslim_turbo {

using kvslim_lowbit::F8;

// a codebook of up to 16 fp32 levels (lo: levels 0-7, hi: 8-15; unused lanes 0)
template <class R>
struct Tab {
  R lo, hi;
};

struct TurboScalar : kvslim_lowbit::LowScalar {
  template <int BITS>
  static inline Tab<R> table(const float* lev) {
    return {load(lev), load(lev + 8)};
  }
  template <int BITS, bool LAST>
  static inline R lut(const uint8_t* p, const Tab<R>& t) {
    uint32_t w = 0;
    for (int i = 0; i < BITS; ++i) w |= static_cast<uint32_t>(p[i]) << (8 * i);
    R r;
    for (int j = 0; j < 8; ++j) {
      const uint32_t c = (w >> (BITS * j)) & ((1u << BITS) - 1);
      r.v[j] = c < 8 ? t.lo.v[c] : t.hi.v[c - 8];
    }
    return r;
  }
};

}  // namespace kvslim_turbo

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvslim_turbo {

struct TurboAVX2 : kvslim_lowbit::LowAVX2 {
  // the levels of a BITS-bit codebook (lev[0, 2^BITS)); 2 bits: lanes 4-7 repeat lanes 0-3 (lut reads 3 index bits)
  template <int BITS>
  static inline Tab<R> table(const float* lev) {
    if (BITS == 2) {
      const __m128 l4 = _mm_loadu_ps(lev);
      return {_mm256_set_m128(l4, l4), load(lev + 8)};
    }
    return {load(lev), load(lev + 8)};
  }
  template <int BITS, bool LAST>
  static inline R lut(const uint8_t* p, const Tab<R>& t) {
    int32_t w;
    std::memcpy(&w, (LAST && BITS < 4) ? p - (4 - BITS) : p, 4);
    __m256i x = _mm256_set1_epi32(w);
    if (LAST && BITS < 4) x = _mm256_srli_epi32(x, 8 * (4 - BITS));
    const __m256i sh = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
    const __m256i c = _mm256_srlv_epi32(x, sh);  // lane j: code j in bits [0, BITS), the next codes above
    const R lo = _mm256_permutevar8x32_ps(t.lo, c);
    if (BITS < 4) return lo;
    const R hi = _mm256_permutevar8x32_ps(t.hi, c);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));  // bit 3 -> the sign
  }
};

}  // namespace kvslim_turbo
#pragma GCC pop_options
