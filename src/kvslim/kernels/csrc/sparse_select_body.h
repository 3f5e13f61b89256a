// The page choice of a sparse decode step (kvslim::sparse_select, and the decode ops' in-call selection):
// included by sparse_select.cpp and by each decode op's source. See sparse_select.cpp for the rule.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "vec_slim.h"

namespace kvslim_select {

// The instruction sets the selection may use: the CPU's (the library is compiled without -march flags: the path
// is chosen at run time), capped by kvslim::sparse_select_set_isa (0 scalar, 1 AVX2, 2 AVX-512; tests compare the
// paths in one process).
inline std::atomic<int>& isa_cap() {
  static std::atomic<int> cap{2};
  return cap;
}

// Page p's [c | r] row (2D values) into fp32 `row`: F16C eight at a time where the CPU has it, else one by one.
inline bool has_avx2() {
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok && isa_cap().load(std::memory_order_relaxed) >= 1;
}

// the box formats: fp32 values, fp16 values, int8 codes × one fp16 scale per `group` channels
enum BoxKind { kF32 = 0, kF16 = 1, kI8 = 2 };
struct Box {
  const void* p;  // page 0 of this (b, h)
  int64_t stride;  // elements between pages
  BoxKind kind;
  const c10::Half* sc = nullptr;  // int8: scales of page 0 of this (b, h)
  int64_t sc_stride = 0, group = 0;
};

// page p + kAhead's box row (`elems` values) and its scales into cache: a box scan is sequential, but the hardware
// prefetchers stop at each 4 KB (one mha-100m layer at 32k × 8, cold, 2 threads: the selection 0.76 -> 0.55-0.60 ms).
// always_inline: a function whose only effect is a prefetch is pure to GCC, which deletes its calls otherwise.
constexpr int64_t kAhead = 16;
__attribute__((always_inline)) inline void prefetch_box(const Box& bx, int64_t p, int64_t n_pages, int64_t elems) {
  if (p + kAhead >= n_pages) return;
  const int64_t esz = bx.kind == kF32 ? 4 : bx.kind == kF16 ? 2 : 1;
  const char* r = static_cast<const char*>(bx.p) + (p + kAhead) * bx.stride * esz;
  for (int64_t o = 0; o < elems * esz; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
  if (bx.sc) _mm_prefetch(reinterpret_cast<const char*>(bx.sc + (p + kAhead) * bx.sc_stride), _MM_HINT_T0);
}

__attribute__((target("avx2,fma,f16c"))) inline void bounds_avx2(const float* q, const float* qa, const Box& bx, int64_t G,
                                                          int64_t D, int64_t n_pages, float scaling, float* s,
                                                          float* row) {
  const bool half = bx.kind == kF16;
  const void* box = bx.p;
  const int64_t stride = bx.stride;
  for (int64_t p = 0; p < n_pages; ++p) {
    prefetch_box(bx, p, n_pages, 2 * D);
    if (bx.kind == kI8) {  // eight codes at a time (a group is a multiple of eight channels: checked)
      const int8_t* bp = static_cast<const int8_t*>(box) + p * stride;
      const uint16_t* sp = reinterpret_cast<const uint16_t*>(bx.sc + p * bx.sc_stride);
      for (int64_t g = 0, i = 0; i < 2 * D; ++g) {  // group by group: one scale each
        const __m256 sc = _mm256_set1_ps(_cvtsh_ss(sp[g]));
        for (const int64_t e = i + bx.group; i < e; i += 8) {
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bp + i))));
          _mm256_storeu_ps(row + i, _mm256_mul_ps(v, sc));
        }
      }
    } else if (half) {
      const uint16_t* bp = static_cast<const uint16_t*>(box) + p * stride;
      for (int64_t i = 0; i < 2 * D; i += 8)
        _mm256_storeu_ps(row + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + i))));
    } else {
      const float* bp = static_cast<const float*>(box) + p * stride;
      for (int64_t i = 0; i < 2 * D; i += 8) _mm256_storeu_ps(row + i, _mm256_loadu_ps(bp + i));
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), _mm256_loadu_ps(row + i), acc);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qa + g * D + i), _mm256_loadu_ps(row + D + i), acc);
      }
      __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
      lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
      s[g * n_pages + p] = _mm_cvtss_f32(lo) * scaling;
    }
  }
}

// lane j of the result: the sum of v[j]'s 16 lanes (16 horizontal sums in 45 shuffles and adds, where 16
// reduce_add calls take ~130)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))) inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], u[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2k], b = v[2k+1]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane the four sums of v[4k .. 4k+3] over that lane
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)  // lanes 0+1 and 2+3 of x[2k], then of x[2k+1]
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// D = 16·NC with int8 boxes in groups of 16 (the library's format at head dims 64 and 128), AVX-512: the page's
// 2·NC vectors converted into registers and scaled there (each scale broadcast from a converted copy: no
// permutes), each head's 16 products of a block of 16 pages kept and summed together by sum16. The selection is
// compute-bound once the boxes are int8: the register path took it from 0.16 to 0.055 ms at batch 1 (one mha-100m
// layer at 32k); the blocked sums from 1.06 to 0.95 ms at batch 8, one thread, warm. Other head dims and the
// fp16/fp32 boxes a caller may pass take the AVX2 path above. `part`: 16·16·G floats of scratch.
template <int NC>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))) void bounds_i8g16(
    const float* q, const float* qa, const Box& bx, int64_t G, int64_t n_pages, float scaling, float* s,
    float* part) {
  constexpr int64_t D = 16 * NC;
  alignas(64) float sf[16];
  for (int64_t p0 = 0; p0 < n_pages; p0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n_pages - p0);
    for (int64_t j = 0; j < cnt; ++j) {
      const int64_t p = p0 + j;
      const int8_t* bp = static_cast<const int8_t*>(bx.p) + p * bx.stride;
      const uint16_t* sp = reinterpret_cast<const uint16_t*>(bx.sc + p * bx.sc_stride);
      prefetch_box(bx, p, n_pages, 2 * D);
      _mm512_store_ps(sf, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << (2 * NC)) - 1), sp)));
      __m512 row[2 * NC];
      for (int i = 0; i < 2 * NC; ++i)
        row[i] = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 16 * i)))),
            _mm512_set1_ps(sf[i]));
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < NC; ++i) {
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * i), row[i], acc);
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(qa + g * D + 16 * i), row[NC + i], acc);
        }
        _mm512_storeu_ps(part + (g * 16 + j) * 16, acc);
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1);
    for (int64_t g = 0; g < G; ++g) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) v[j] = j < cnt ? _mm512_loadu_ps(part + (g * 16 + j) * 16) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(s + g * n_pages + p0, keep, _mm512_mul_ps(sum16(v), _mm512_set1_ps(scaling)));
    }
  }
}

inline bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok && has_avx2() && isa_cap().load(std::memory_order_relaxed) >= 2;
}

inline void bounds_scalar(const float* q, const float* qa, const Box& bx, int64_t G, int64_t D, int64_t n_pages,
                   float scaling, float* s, float* row) {
  for (int64_t p = 0; p < n_pages; ++p) {
    const int64_t o = p * bx.stride;
    for (int64_t i = 0; i < 2 * D; ++i)
      row[i] = bx.kind == kI8   ? static_cast<float>(static_cast<const int8_t*>(bx.p)[o + i]) *
                                    static_cast<float>(bx.sc[p * bx.sc_stride + i / bx.group])
               : bx.kind == kF16 ? static_cast<float>(static_cast<const c10::Half*>(bx.p)[o + i])
                                 : static_cast<const float*>(bx.p)[o + i];
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t i = 0; i < D; ++i) acc += q[g * D + i] * row[i] + qa[g * D + i] * row[D + i];
      s[g * n_pages + p] = acc * scaling;
    }
  }
}

// order-preserving unsigned key of a score (a larger score, a larger key; −0 and +0 one key, as they compare
// equal); NaN below every number
inline uint32_t order_key(float f) {
  if (f != f) return 0;
  if (f == 0.f) f = 0.f;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// the pages of keys above t, then the `need` lowest pages at t, into idx in page order (both selects' last pass)
inline void take_top(const uint32_t* key, int64_t n, uint32_t t, int64_t need, int64_t* idx) {
  int64_t o = 0;
  for (int64_t p = 0; p < n; ++p)
    if (key[p] > t || (key[p] == t && need-- > 0)) idx[o++] = p;
}

// the kk best of score[0, n) (the larger first, ties to the lower page) into idx, ascending: a radix select on the
// scores' order-preserving bits (digits of 11, 11 and 10 bits, each pass over the candidates the last one left:
// after the first, the few pages in the bucket that holds the kk-th), which fixes the kk-th best key T and how many
// pages equal to it are taken; then one pass in page order takes every page above T and the lowest pages at T.
// Branch-light where a heap of the best so far mispredicted its insertions: 60 % of the op at k = 64, 74 % at
// k = 128 (one mha-100m layer at 32k × 8: 0.72 / 1.10 ms against 0.29 ms at k = 1).
inline void top_pages_radix(const float* score, int64_t n, int64_t kk, int64_t* idx) {
  if (kk <= 0) return;
  if (kk >= n) {
    for (int64_t p = 0; p < n; ++p) idx[p] = p;
    return;
  }
  std::vector<uint32_t> key(static_cast<size_t>(n));
  std::vector<int32_t> cand(static_cast<size_t>(n));
  constexpr int kShift[3] = {21, 10, 0}, kBits[3] = {11, 11, 10};
  int32_t hist[1 << 11];
  uint32_t t = 0;  // the kk-th best key, built digit by digit
  int64_t need = kk, nc = 0;  // the best still to take among the nc candidates (keys matching t so far)
  for (int l = 0; l < 3; ++l) {
    const int sh = kShift[l];
    const uint32_t dm = (1u << kBits[l]) - 1;
    std::fill(hist, hist + dm + 1, 0);
    if (l == 0) {  // every page: its key, and the histogram of the top digit
      for (int64_t p = 0; p < n; ++p) ++hist[(key[p] = order_key(score[p])) >> sh];
    } else {
      for (int64_t i = 0; i < nc; ++i) ++hist[(key[cand[i]] >> sh) & dm];
    }
    uint32_t d = dm;
    for (; d > 0 && hist[d] < need; --d) need -= hist[d];  // whole buckets above the kk-th: all taken
    t |= d << sh;
    int64_t m = 0;
    if (l == 0) {
      for (int64_t p = 0; p < n; ++p)
        if ((key[p] >> sh) == d) cand[m++] = static_cast<int32_t>(p);
    } else {
      for (int64_t i = 0; i < nc; ++i)
        if (((key[cand[i]] >> sh) & dm) == d) cand[m++] = cand[i];
    }
    nc = m;
  }
  take_top(key.data(), n, t, need, idx);
}

// top_pages_radix's choice for few pages (n < kSmallPages, where the radix select's three 2,048-bucket histograms
// cost more than the pages: 7 % of one int4 layer's sparse op at 4k × 8, 124 pages, profiled): nth_element on the
// keys fixes the kk-th best key T, one pass in page order takes the pages above it and the lowest at it.
constexpr int64_t kSmallPages = 512;
inline void top_pages_small(const float* score, int64_t n, int64_t kk, int64_t* idx) {
  if (kk <= 0) return;
  uint32_t buf[kSmallPages], key[kSmallPages];
  for (int64_t p = 0; p < n; ++p) buf[p] = key[p] = order_key(score[p]);
  std::nth_element(buf, buf + (kk - 1), buf + n, std::greater<uint32_t>());
  const uint32_t t = buf[kk - 1];
  int64_t need = kk;
  for (int64_t p = 0; p < n; ++p) need -= key[p] > t;  // the pages at T to take
  take_top(key, n, t, need, idx);
}

// the lanes of pages [p, min(p + 16, n)) in a 16-lane mask
inline __mmask16 lanes16(int64_t p, int64_t n) {
  return p + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - p)) - 1);
}

// top_pages_radix's choice, AVX-512 (n ≥ 128, kk < n): the keys sixteen at a time; a pivot from a sorted sample of
// 64 keys, lowered until at least kk keys reach it (a compare and a popcount per sixteen pages); the keys at or above
// it (~1.5-3 kk) compressed out and cut exactly (nth_element: the kk-th best key T, how many equal to T are taken);
// then one pass in page order compresses out the pages above T and the lowest at T. The same pages as the radix
// select (tested against it and a sort at every instruction set); ~4 vector passes where the radix pass took
// ~12 cycles a page (12 % of one int4 layer's sparse op at 32k × 8, profiled).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline void top_pages_avx512(
    const float* score, int64_t n, int64_t kk, int64_t* idx) {
  std::vector<uint32_t> key(static_cast<size_t>(n + 16));
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  int64_t p = 0;
  for (; p < n; p += 16) {  // order_key, sixteen at a time (the tail masked)
    const __mmask16 live = lanes16(p, n);
    const __m512 f = _mm512_maskz_loadu_ps(live, score + p);
    __m512i u = _mm512_castps_si512(f);
    u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_EQ_OQ), _mm512_setzero_si512());
    const __mmask16 neg = _mm512_movepi32_mask(u);
    __m512i k = _mm512_mask_mov_epi32(_mm512_or_si512(u, sign), neg, _mm512_xor_si512(u, _mm512_set1_epi32(-1)));
    k = _mm512_maskz_mov_epi32(static_cast<__mmask16>(live & ~_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q)), k);
    _mm512_storeu_si512(key.data() + p, k);
  }
  // the pivot: the j-th largest of 64 evenly spaced keys, j from the expected count; lowered while too few reach it
  constexpr int kSample = 64;
  uint32_t sample[kSample];
  for (int i = 0; i < kSample; ++i) sample[i] = key[static_cast<size_t>(i * n / kSample)];
  std::sort(sample, sample + kSample, std::greater<uint32_t>());
  int64_t j = std::min<int64_t>(kSample - 1, (kk * kSample * 3 / 2) / n + 2);
  uint32_t pivot = 0;
  int64_t count = n;
  for (;;) {
    pivot = j >= kSample - 1 ? 0u : sample[j];
    if (pivot == 0) {  // every key (0: NaN, the least) reaches it
      count = n;
      break;
    }
    const __m512i pv = _mm512_set1_epi32(static_cast<int>(pivot));
    count = 0;
    for (p = 0; p < n; p += 16) {
      const __mmask16 live = lanes16(p, n);
      count += __builtin_popcount(_mm512_mask_cmpge_epu32_mask(live, _mm512_loadu_si512(key.data() + p), pv));
    }
    if (count >= kk) break;
    j = std::min<int64_t>(kSample - 1, 2 * j + 2);
  }
  // the candidates' keys, then the kk-th best among them and how many at it are taken
  std::vector<uint32_t> cand(static_cast<size_t>(count + 16));
  const __m512i pv = _mm512_set1_epi32(static_cast<int>(pivot));
  int64_t c = 0;
  for (p = 0; p < n; p += 16) {
    const __mmask16 live = lanes16(p, n);
    const __m512i kv = _mm512_loadu_si512(key.data() + p);
    const __mmask16 m = _mm512_mask_cmpge_epu32_mask(live, kv, pv);
    _mm512_mask_compressstoreu_epi32(cand.data() + c, m, kv);
    c += __builtin_popcount(m);
  }
  std::nth_element(cand.begin(), cand.begin() + (kk - 1), cand.begin() + c, std::greater<uint32_t>());
  const uint32_t t = cand[static_cast<size_t>(kk - 1)];
  int64_t need = kk;
  for (int64_t i = 0; i < c; ++i) need -= cand[i] > t;  // pages at t still to take, the lowest first
  const __m512i tv = _mm512_set1_epi32(static_cast<int>(t));
  const __m512i step = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  int64_t o = 0;
  alignas(64) int32_t got[16];
  for (p = 0; p < n && o < kk; p += 16) {
    const __mmask16 live = lanes16(p, n);
    const __m512i kv = _mm512_loadu_si512(key.data() + p);
    __mmask16 m = _mm512_mask_cmpgt_epu32_mask(live, kv, tv);
    __mmask16 eq = _mm512_mask_cmpeq_epu32_mask(live, kv, tv);
    while (eq && need > 0) {  // the lowest pages at t, while any are still to take
      const __mmask16 low = static_cast<__mmask16>(eq & -eq);
      m |= low;
      eq &= static_cast<__mmask16>(eq - 1);
      --need;
    }
    _mm512_mask_compressstoreu_epi32(got, m, _mm512_add_epi32(step, _mm512_set1_epi32(static_cast<int>(p))));
    for (int i = 0, e = __builtin_popcount(m); i < e; ++i) idx[o++] = got[i];
  }
}

// the kk best of score[0, n) (the larger first, ties to the lower page) into idx, ascending
inline void top_pages(const float* score, int64_t n, int64_t kk, int64_t* idx) {
  if (kk > 0 && kk < n && n >= 128 && n < (int64_t{1} << 31) && has_avx512())
    top_pages_avx512(score, n, kk, idx);
  else if (kk > 0 && kk < n && n < kSmallPages)
    top_pages_small(score, n, kk, idx);
  else
    top_pages_radix(score, n, kk, idx);
}

// G > 1 (select_task): each head's bounds made a log-softmax over the pages in place, then score_p = logsumexp_g,
// sixteen pages at a time with the library's vector exp (Cephes, max relative error ~2e-7; 0 below −87.3, where
// std::exp gives a subnormal). The scalar loops below it took ~2/3 of a G = 7 selection (2G exps per page).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline void combine_heads_avx512(
    float* s, int64_t G, int64_t n, float* score) {
  using V = kvslim_vec::VecAVX512;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill(score, score + n, ninf);  // the running max over the heads, per page
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * n;
    auto vm = V::set1(ninf);
    int64_t p = 0;
    for (; p + 16 <= n; p += 16) vm = V::max(V::load(sg + p), vm);
    float mx = V::hmax(vm);
    for (; p < n; ++p) mx = std::max(mx, sg[p]);
    const auto vmx = V::set1(mx);
    auto vs = V::zero();
    for (p = 0; p + 16 <= n; p += 16) vs = V::add(vs, V::exp(V::sub(V::load(sg + p), vmx)));
    float sum = V::hsum(vs);
    for (; p < n; ++p) sum += std::exp(sg[p] - mx);
    const float lse = mx + std::log(sum);
    const auto vl = V::set1(lse);
    for (p = 0; p + 16 <= n; p += 16) {
      const auto x = V::sub(V::load(sg + p), vl);
      V::store(sg + p, x);
      V::store(score + p, V::max(x, V::load(score + p)));
    }
    for (; p < n; ++p) {
      sg[p] -= lse;
      score[p] = std::max(score[p], sg[p]);
    }
  }
  alignas(64) float t[16];
  for (int64_t p = 0; p < n; p += 16) {
    const int64_t c = std::min<int64_t>(16, n - p);
    const __mmask16 keep = static_cast<__mmask16>((1u << c) - 1);
    const __m512 m = _mm512_maskz_loadu_ps(keep, score + p);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) sum = V::add(sum, V::exp(V::sub(_mm512_maskz_loadu_ps(keep, s + g * n + p), m)));
    _mm512_store_ps(t, sum);
    for (int64_t j = 0; j < c; ++j) score[p + j] += std::log(t[j]);
  }
}

inline void select_task(const float* q, Box bx, int64_t G, int64_t D, int64_t n_pages, float scaling, int64_t k,
                 bool force_first, int64_t rest, int64_t* out, int64_t p0 = 0) {
  // candidates: pages [p0, n_pages) (p0 > 0: a padded sequence), their indices shifted back when written
  const int64_t esz = bx.kind == kF32 ? 4 : bx.kind == kF16 ? 2 : 1;
  bx.p = static_cast<const char*>(bx.p) + p0 * bx.stride * esz;
  if (bx.sc) bx.sc += p0 * bx.sc_stride;
  const int64_t all_pages = n_pages;
  n_pages -= p0;
  std::vector<float> s(static_cast<size_t>(G * n_pages));
  std::vector<float> row(static_cast<size_t>(2 * D));
  std::vector<float> qa(static_cast<size_t>(G * D));
  for (int64_t i = 0; i < G * D; ++i) qa[i] = std::fabs(q[i]);
  if (bx.kind == kI8 && bx.group == 16 && (D == 64 || D == 128) && has_avx512()) {
    std::vector<float> part(static_cast<size_t>(G * 256));
    if (D == 64)
      bounds_i8g16<4>(q, qa.data(), bx, G, n_pages, scaling, s.data(), part.data());
    else
      bounds_i8g16<8>(q, qa.data(), bx, G, n_pages, scaling, s.data(), part.data());
  } else if (D % 8 == 0 && (bx.kind != kI8 || bx.group % 8 == 0) && has_avx2())
    bounds_avx2(q, qa.data(), bx, G, D, n_pages, scaling, s.data(), row.data());
  else
    bounds_scalar(q, qa.data(), bx, G, D, n_pages, scaling, s.data(), row.data());
  std::vector<float> score(static_cast<size_t>(n_pages));
  if (G == 1) {  // one head: its log-softmax is its bound less a constant, the same ranking
    std::copy(s.begin(), s.end(), score.begin());
  } else if (has_avx512()) {
    combine_heads_avx512(s.data(), G, n_pages, score.data());
  } else {
    std::vector<float> m(static_cast<size_t>(n_pages), -std::numeric_limits<float>::infinity());
    for (int64_t g = 0; g < G; ++g) {  // log-softmax of each head over the pages, then logsumexp over the heads
      float* sg = s.data() + g * n_pages;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < n_pages; ++p) mx = std::max(mx, sg[p]);
      double sum = 0.0;
      for (int64_t p = 0; p < n_pages; ++p) sum += std::exp(sg[p] - mx);
      const float lse = mx + static_cast<float>(std::log(sum));
      for (int64_t p = 0; p < n_pages; ++p) {
        sg[p] -= lse;
        m[p] = std::max(m[p], sg[p]);
      }
    }
    for (int64_t p = 0; p < n_pages; ++p) {
      float sum = 0.f;
      for (int64_t g = 0; g < G; ++g) sum += std::exp(s[g * n_pages + p] - m[p]);
      score[p] = m[p] + std::log(sum);
    }
  }
  if (force_first && n_pages > 0) score[0] = std::numeric_limits<float>::infinity();
  const int64_t kk = std::min(k, n_pages);
  top_pages(score.data(), n_pages, kk, out);
  for (int64_t i = 0; i < kk; ++i) out[i] += p0;
  for (int64_t i = 0; i < rest; ++i) out[kk + i] = all_pages + i;
}

inline at::Tensor select(const char* OP, const at::Tensor& q, const at::Tensor& boxes, int64_t n_pages, int64_t k,
                         double scaling, bool force_first, int64_t rest, const c10::optional<at::Tensor>& first,
                         const c10::optional<at::Tensor>& force, const c10::optional<at::Tensor>& scales) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
                    OP, ": q must be a contiguous (B, H, G, D) fp32 tensor, got ", q.sizes(), " ",
                    q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(boxes.dim() == 4 && boxes.size(0) == B && boxes.size(1) == H && boxes.size(3) == 2 * D &&
                        boxes.stride(3) == 1 &&
                        (boxes.scalar_type() == at::kHalf || boxes.scalar_type() == at::kFloat ||
                         boxes.scalar_type() == at::kChar),
                    OP, ": boxes must be (B, H, pages, 2D) fp16/fp32/int8 with unit last stride, got ",
                    boxes.sizes(), " ", boxes.scalar_type());
  const bool coded = boxes.scalar_type() == at::kChar;
  const bool has_scales = scales.has_value() && scales->defined();
  TORCH_CHECK_VALUE(coded == has_scales, OP, ": int8 boxes need scales and only they take them, got ",
                    boxes.scalar_type(), " boxes ", has_scales ? "with" : "without", " scales");
  int64_t group = 0;
  if (coded) {
    const at::Tensor& sc = *scales;
    TORCH_CHECK_VALUE(sc.device().is_cpu() && sc.scalar_type() == at::kHalf && sc.dim() == 4 && sc.size(0) == B &&
                          sc.size(1) == H && sc.size(2) >= n_pages && sc.size(3) >= 2 && sc.size(3) <= 2 * D &&
                          (2 * D) % sc.size(3) == 0 &&
                          D % ((2 * D) / sc.size(3)) == 0 && sc.stride(3) == 1,
                      OP, ": scales must be fp16 (B, H, >= n_pages, 2D / group) with a group "
                      "dividing D=", D, " and unit last stride, got ", sc.sizes(), " ", sc.scalar_type());
    group = (2 * D) / sc.size(3);
  }
  TORCH_CHECK_VALUE(n_pages >= 0 && n_pages <= boxes.size(2), OP, ": n_pages=", n_pages,
                    " outside the boxes' ", boxes.size(2), " pages");
  TORCH_CHECK_VALUE(k >= 1 && rest >= 0, OP, ": k must be >= 1 and rest >= 0, got ", k, ", ", rest);
  const int64_t kk = std::min(k, n_pages);
  const bool padded = first.has_value() && first->defined();
  TORCH_CHECK_VALUE(padded == (force.has_value() && force->defined()),
                    OP, ": first and force come together");
  at::Tensor first_c, force_c;
  const int64_t* fp = nullptr;
  const bool* fo = nullptr;
  if (padded) {
    TORCH_CHECK_VALUE(first->device().is_cpu() && first->scalar_type() == at::kLong && first->dim() == 1 &&
                          first->size(0) == B && force->device().is_cpu() && force->scalar_type() == at::kBool &&
                          force->dim() == 1 && force->size(0) == B,
                      OP, ": first must be int64 (B=", B, ",) and force bool (B,) on CPU, got ",
                      first->sizes(), " ", first->scalar_type(), " and ", force->sizes(), " ", force->scalar_type());
    first_c = first->contiguous();
    force_c = force->contiguous();
    fp = first_c.data_ptr<int64_t>();
    fo = force_c.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(fp[b] >= 0 && n_pages - fp[b] >= kk, OP, ": first[", b, "] = ", fp[b],
                        " leaves fewer than k=", kk, " of the ", n_pages, " pages");
  }
  at::Tensor out = at::empty({B, H, kk + rest}, q.options().dtype(at::kLong));
  const float* qp = q.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t s0 = boxes.stride(0), s1 = boxes.stride(1), s2 = boxes.stride(2);
  const BoxKind kind = coded ? kI8 : boxes.scalar_type() == at::kHalf ? kF16 : kF32;
  const int64_t esz = boxes.element_size();
  const char* bp = static_cast<const char*>(boxes.data_ptr());
  const c10::Half* scp = coded ? scales->data_ptr<c10::Half>() : nullptr;
  const int64_t c0 = coded ? scales->stride(0) : 0, c1 = coded ? scales->stride(1) : 0,
                c2 = coded ? scales->stride(2) : 0;
  const float sc = static_cast<float>(scaling);
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / H, h = t % H;
      const float* qt = qp + t * G * D;
      int64_t* ot = op + t * (kk + rest);
      Box bx{bp + (b * s0 + h * s1) * esz, s2, kind};
      if (coded) {
        bx.sc = scp + b * c0 + h * c1;
        bx.sc_stride = c2;
        bx.group = group;
      }
      if (padded)
        select_task(qt, bx, G, D, n_pages, sc, kk, fo[b], rest, ot, fp[b]);
      else
        select_task(qt, bx, G, D, n_pages, sc, kk, force_first, rest, ot);
    }
  });
  return out;
}


// A decode op's page list, chosen in the call: with `boxes`, the pages of the step's queries `sel_q` (B, Hk, G, D)
// fp32 (the model's basis, as kvslim::sparse_select takes them) over the first `n_pages` boxes, the best `k` (page 0
// forced when `force_first`) ascending, then pages [n_pages, n_pages + rest) (select above); the chosen part copied
// into `chosen` (B, Hk, min(k, n_pages)) int64 when given (select="prompt": the cache's buffer) by write_chosen, which
// the op calls once every check has passed (a refused call writes nothing). Without `boxes`: `pages` as given (a
// list chosen elsewhere, or none).
inline c10::optional<at::Tensor> in_call(const char* OP, const c10::optional<at::Tensor>& pages,
                                         const c10::optional<at::Tensor>& sel_q, const c10::optional<at::Tensor>& boxes,
                                         const c10::optional<at::Tensor>& box_scales, int64_t n_pages, int64_t k,
                                         bool force_first, int64_t rest, const c10::optional<at::Tensor>& chosen,
                                         double scaling) {
  if (!boxes.has_value()) {
    TORCH_CHECK_VALUE(!sel_q.has_value() && !box_scales.has_value() && !chosen.has_value(), OP,
                      ": sel_q, box_scales and chosen come with boxes (the page choice made in the call)");
    return pages;
  }
  TORCH_CHECK_VALUE(!pages.has_value(), OP, ": pages and boxes exclude each other (a page list, or the boxes to "
                    "choose one from)");
  TORCH_CHECK_VALUE(sel_q.has_value(), OP, ": boxes need sel_q, the step's queries (B, Hk, G, D) fp32");
  at::Tensor listed = select(OP, *sel_q, *boxes, n_pages, k, scaling, force_first, rest, c10::nullopt, c10::nullopt,
                             box_scales);
  if (chosen.has_value()) {
    const at::Tensor& c = *chosen;
    const int64_t kk = listed.size(2) - rest;
    TORCH_CHECK_VALUE(c.device().is_cpu() && c.scalar_type() == at::kLong && c.dim() == 3 &&
                          c.size(0) == listed.size(0) && c.size(1) == listed.size(1) && c.size(2) == kk,
                      OP, ": chosen must be an int64 CPU tensor of shape (", listed.size(0), ", ", listed.size(1),
                      ", ", kk, "), got ", c.scalar_type(), " ", c.sizes());
  }
  return listed;
}

// the chosen part of an in-call list into `chosen` (checked by in_call), after the op's own checks
inline void write_chosen(const c10::optional<at::Tensor>& chosen, const c10::optional<at::Tensor>& listed) {
  if (chosen.has_value() && listed.has_value()) chosen->copy_(listed->narrow(2, 0, chosen->size(2)));
}

}  // namespace kvslim_select
