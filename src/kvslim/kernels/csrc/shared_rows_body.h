// One pass of h query heads over rows shared by all heads (no include guard: shared_rows.h includes this once per
// instruction set, inside `namespace KVSLIM_ISA` with `using V = <traits>` and the matching #pragma GCC target).
//
// For a chunk of T rows: (1) fp32 rows (bf16 widened into a scratch buffer), (2) h scores per row (raw RoPE
// storage: the rotation folded into the query side row by row, no rotated copy of the keys; else 4 rows at a time,
// transpose-reduced), (3) online softmax per head (rescale only when the running max grows), (4) the rows the
// weighted sum needs (un-rotated on the fly for rotated storage), (5) acc[h][c] += p[h][T] · rows[T][c] as a register-blocked (heads × columns)
// tile loop that reads each row once per head group from L1. Every index is bounded by Args (set from tensor
// metadata by the op and checked there).

#include "dots4_body.h"

// locality of the next chunk's prefetches: L2 (`prefetcht1`), not L1. The next chunk (96 KB) is larger than L1;
// fetched into L1 it evicted the rows the current chunk's tiles re-read from there (AVX-512 machine, in-process
// A/B: slim 8k × 8 1.13–1.32× with 2 threads, 1.13× with 1; Whisper cross-attention batch 64 1.13×, batch 8
// 1.10×; rows already in cache (1k × 1, batch 1) unchanged). The next *tile*'s rows still go to L1.
constexpr int kNextChunk = 2;

// widen `len` values to fp32
template <class T>
inline void widen(const T* src, float* dst, int64_t len) {
  int64_t i = 0;
  for (; i + V::W <= len; i += V::W) V::store(dst + i, V::load(src + i));
  for (; i < len; ++i) dst[i] = kvslim_vec::to_f32(src[i]);
}

// inverse RoPE (−θ) of the h key heads of one fp32 row (dst may equal src; channels R..dk are copied). The cos/sin
// vectors are loaded once per column block and reused by every head.
inline void unrope_row(const float* src, float* dst, const float* cs, const float* sn, int64_t h, int64_t dk,
                       int64_t R) {
  const int64_t half = R / 2;
  int64_t i = 0;
  for (; i + V::W <= half; i += V::W) {
    const auto c1 = V::load(cs + i), c2 = V::load(cs + half + i), s1 = V::load(sn + i), s2 = V::load(sn + half + i);
    for (int64_t j = 0; j < h; ++j) {
      const float* k = src + j * dk;
      float* o = dst + j * dk;
      const auto lo = V::load(k + i), hi = V::load(k + half + i);
      V::store(o + i, V::fma(hi, s1, V::mul(lo, c1)));
      V::store(o + half + i, V::sub(V::mul(hi, c2), V::mul(lo, s2)));
    }
  }
  for (int64_t j = 0; j < h; ++j) {
    const float* k = src + j * dk;
    float* o = dst + j * dk;
    for (int64_t x = i; x < half; ++x) {
      const float lo = k[x], hi = k[half + x];
      o[x] = lo * cs[x] + hi * sn[x];
      o[half + x] = hi * cs[half + x] - lo * sn[half + x];
    }
    if (dst != src)
      for (int64_t t = R; t < dk; ++t) o[t] = k[t];
  }
}

// scores of all heads for rows [0, m), 4 rows at a time walking each row front to back (prefetch-friendly):
// sc[j·ps + t] = scaling · q_j · krow_t[j·koff : j·koff + L] + mask[t]
inline void scores(const float* q, int64_t h, int64_t koff, int64_t L, const float* krows, int64_t krs, int64_t m,
                   float scaling, const float* mask, float* sc, int64_t ps) {
  float s[4];
  for (int64_t t = 0; t < m; t += 4) {
    const int64_t r4 = std::min<int64_t>(4, m - t);
    for (int64_t j = 0; j < h; ++j) {
      dots4(q + j * L, krows + t * krs + j * koff, L, r4, krs, s);
      for (int64_t r = 0; r < r4; ++r) sc[j * ps + t + r] = s[r] * scaling + (mask ? mask[t + r] : 0.f);
    }
  }
}

// scores of NH heads of one raw (un-rotated) row with RoPE folded into the query side, no rotated copy of the
// row: q · rot_t(k) = Σ_i k_lo,i (q_lo,i c1_i + q_hi,i s2_i) + k_hi,i (q_hi,i c2_i − q_lo,i s1_i) over the first R
// channels (c1/s1 the table's first half, c2/s2 its second), then the plain product over channels R..dk. The
// row's cos/sin vectors are loaded once per NH heads.
template <int NH>
inline void scores_rope_heads(const float* q, int64_t dk, int64_t R, const float* row, const float* cs,
                              const float* sn, float* s) {
  const int64_t half = R / 2;
  typename V::R a[NH];
#pragma GCC unroll 4
  for (int hh = 0; hh < NH; ++hh) a[hh] = V::zero();
  int64_t i = 0;
  for (; i + V::W <= half; i += V::W) {
    const auto c1 = V::load(cs + i), c2 = V::load(cs + half + i), s1 = V::load(sn + i), s2 = V::load(sn + half + i);
#pragma GCC unroll 4
    for (int hh = 0; hh < NH; ++hh) {
      const float *qj = q + hh * dk, *kj = row + hh * dk;
      const auto qlo = V::load(qj + i), qhi = V::load(qj + half + i);
      const auto qa = V::fma(qhi, s2, V::mul(qlo, c1)), qb = V::sub(V::mul(qhi, c2), V::mul(qlo, s1));
      a[hh] = V::fma(V::load(kj + half + i), qb, V::fma(V::load(kj + i), qa, a[hh]));
    }
  }
  int64_t p = R;
  for (; p + V::W <= dk; p += V::W)
#pragma GCC unroll 4
    for (int hh = 0; hh < NH; ++hh) a[hh] = V::fma(V::load(q + hh * dk + p), V::load(row + hh * dk + p), a[hh]);
#pragma GCC unroll 4
  for (int hh = 0; hh < NH; ++hh) {
    const float *qj = q + hh * dk, *kj = row + hh * dk;
    float x = V::hsum(a[hh]);
    for (int64_t z = i; z < half; ++z)
      x += kj[z] * (qj[z] * cs[z] + qj[half + z] * sn[half + z]) +
           kj[half + z] * (qj[half + z] * cs[half + z] - qj[z] * sn[z]);
    for (int64_t z = p; z < dk; ++z) x += qj[z] * kj[z];
    s[hh] = x;
  }
}

// scores of all h heads over rows [0, m) of raw keys (RoPE on the fly, see scores_rope_heads)
inline void scores_rope(const float* q, int64_t h, int64_t dk, int64_t R, const float* rows, int64_t rs,
                        const float* cos, int64_t cos_rs, const float* sin, int64_t sin_rs, int64_t m, float scaling,
                        const float* mask, float* sc, int64_t ps) {
  float s[4];
  for (int64_t t = 0; t < m; ++t) {
    const float *row = rows + t * rs, *cs = cos + t * cos_rs, *sn = sin + t * sin_rs;
    const float add = mask ? mask[t] : 0.f;
    for (int64_t j = 0; j < h; j += 4) {
      const int64_t nh = std::min<int64_t>(4, h - j);
      switch (nh) {
        case 4: scores_rope_heads<4>(q + j * dk, dk, R, row + j * dk, cs, sn, s); break;
        case 3: scores_rope_heads<3>(q + j * dk, dk, R, row + j * dk, cs, sn, s); break;
        case 2: scores_rope_heads<2>(q + j * dk, dk, R, row + j * dk, cs, sn, s); break;
        default: scores_rope_heads<1>(q + j * dk, dk, R, row + j * dk, cs, sn, s); break;
      }
      for (int64_t r = 0; r < nh; ++r) sc[(j + r) * ps + t] = s[r] * scaling + add;
    }
  }
}

// scores of NH heads × 4 rows when every head scores the whole row (koff = 0, the encoder-decoder case): each
// row vector loaded once serves NH heads and each query vector 4 rows (7 loads per 12 FMAs for NH = 3, instead of
// 5 per 4 head by head). The empty asm keeps the 4 row vectors in registers: without it GCC folds them into the
// FMAs as memory operands and loads every row vector NH times (15 loads per 12 FMAs). PF: the next tile's 4 rows
// (`nxt`) are fetched into L1 a line per row and vector step while these compute (the chunk's rows come from L2;
// the first loads of each row were the op's hottest instructions). Measured, the Whisper cross-attention op alone
// (6 heads, 1500 frames, in-process A/B): 1.27× at batch 8 (1 thread), 1.08–1.13× at batch 64 (2 threads).
template <int NH, bool PF>
inline void scores_shared_tile(const float* q, int64_t L, const float* k0, int64_t krs, float scaling,
                               const float* mask, float* sc, int64_t ps, const float* nxt) {
  const float *k1 = k0 + krs, *k2 = k1 + krs, *k3 = k2 + krs;
  typename V::R a[NH][4];
#pragma GCC unroll 4
  for (int hh = 0; hh < NH; ++hh) a[hh][0] = a[hh][1] = a[hh][2] = a[hh][3] = V::zero();
  int64_t i = 0;
  for (; i + V::W <= L; i += V::W) {
    auto r0 = V::load(k0 + i), r1 = V::load(k1 + i), r2 = V::load(k2 + i), r3 = V::load(k3 + i);
    asm("" : "+v"(r0), "+v"(r1), "+v"(r2), "+v"(r3));
    if (PF)
      for (int r = 0; r < 4; ++r) __builtin_prefetch(nxt + r * krs + i, 0, 3);
#pragma GCC unroll 4
    for (int hh = 0; hh < NH; ++hh) {
      const auto qv = V::load(q + hh * L + i);
      a[hh][0] = V::fma(qv, r0, a[hh][0]);
      a[hh][1] = V::fma(qv, r1, a[hh][1]);
      a[hh][2] = V::fma(qv, r2, a[hh][2]);
      a[hh][3] = V::fma(qv, r3, a[hh][3]);
    }
  }
  for (int hh = 0; hh < NH; ++hh) {
    float s[4];
    V::hsum4(a[hh][0], a[hh][1], a[hh][2], a[hh][3], s);
    const float* qj = q + hh * L;
    for (int64_t x = i; x < L; ++x) {
      s[0] += qj[x] * k0[x];
      s[1] += qj[x] * k1[x];
      s[2] += qj[x] * k2[x];
      s[3] += qj[x] * k3[x];
    }
    for (int r = 0; r < 4; ++r) sc[hh * ps + r] = s[r] * scaling + (mask ? mask[r] : 0.f);
  }
}

// scores_shared_tile with the next tile's rows fetched when `nxt` is given
template <int NH>
inline void scores_shared_tile_pf(const float* q, int64_t L, const float* k0, int64_t krs, float scaling,
                                  const float* mask, float* sc, int64_t ps, const float* nxt) {
  if (nxt) scores_shared_tile<NH, true>(q, L, k0, krs, scaling, mask, sc, ps, nxt);
  else scores_shared_tile<NH, false>(q, L, k0, krs, scaling, mask, sc, ps, nxt);
}

// scores of all heads over whole rows (koff = 0): 4 rows × up to 3 heads per register tile, then the row tail
inline void scores_shared(const float* q, int64_t h, int64_t L, const float* krows, int64_t krs, int64_t m,
                          float scaling, const float* mask, float* sc, int64_t ps) {
  int64_t t = 0;
  for (; t + 4 <= m; t += 4)
    for (int64_t j = 0; j < h; j += 3) {
      const float* k0 = krows + t * krs;
      const float* mk = mask ? mask + t : nullptr;
      // the first head group reads the rows from L2: it fetches the next tile's rows
      const float* nxt = j == 0 && t + 8 <= m ? k0 + 4 * krs : nullptr;
      float* st = sc + j * ps + t;
      switch (std::min<int64_t>(3, h - j)) {
        case 3: scores_shared_tile_pf<3>(q + j * L, L, k0, krs, scaling, mk, st, ps, nxt); break;
        case 2: scores_shared_tile_pf<2>(q + j * L, L, k0, krs, scaling, mk, st, ps, nxt); break;
        default: scores_shared_tile_pf<1>(q + j * L, L, k0, krs, scaling, mk, st, ps, nxt); break;
      }
    }
  if (t < m) scores(q, h, 0, L, krows + t * krs, krs, m - t, scaling, mask ? mask + t : nullptr, sc + t, ps);
}

// acc[hh][col..] += Σ_t p[hh][t] · rows[t][col..] for NH heads × NV vectors of columns
template <int NH, int NV>
inline void tile(float* acc, int64_t c, const float* p, int64_t ps, const float* rows, int64_t rs, int64_t m,
                 const char* pfp = nullptr, int64_t pfn = 0) {
  typename V::R a[NH][NV];
#pragma GCC unroll 8
  for (int hh = 0; hh < NH; ++hh)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) a[hh][v] = V::load(acc + hh * c + v * V::W);
  for (int64_t t = 0; t < m; ++t) {
    if (t < pfn) __builtin_prefetch(pfp + 64 * t, 0, kNextChunk);  // one line of the next chunk per row step
    typename V::R r[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) r[v] = V::load(rows + t * rs + v * V::W);
#pragma GCC unroll 8
    for (int hh = 0; hh < NH; ++hh) {
      const auto pb = V::set1(p[hh * ps + t]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) a[hh][v] = V::fma(pb, r[v], a[hh][v]);
    }
  }
#pragma GCC unroll 8
  for (int hh = 0; hh < NH; ++hh)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) V::store(acc + hh * c + v * V::W, a[hh][v]);
}

template <int NV>
inline void tile_heads(int nh, float* acc, int64_t c, const float* p, int64_t ps, const float* rows, int64_t rs,
                       int64_t m, const char* pfp = nullptr, int64_t pfn = 0) {
  switch (nh) {
    case 4: tile<4, NV>(acc, c, p, ps, rows, rs, m, pfp, pfn); break;
    case 3: tile<3, NV>(acc, c, p, ps, rows, rs, m, pfp, pfn); break;
    case 2: tile<2, NV>(acc, c, p, ps, rows, rs, m, pfp, pfn); break;
    default: tile<1, NV>(acc, c, p, ps, rows, rs, m, pfp, pfn); break;
  }
}

// acc (h, c) += p · rows with NH-head × NV-vector tiles, h a multiple of NH (each row slice read from L1 once per
// head group), then NH × 1-vector tiles and scalar columns; each column block fetches its share of the next chunk,
// one line per row step of its tiles (Prefetch::share)
struct Prefetch;
template <int NH, int NV>
inline void accumulate_groups(float* acc, int64_t h, int64_t c, const float* p, int64_t ps, const float* rows,
                              int64_t rs, int64_t m, const Prefetch& pf);

// rows the next chunk will read, fetched into cache while this chunk computes (the accumulation reads only
// L2-resident rows, so without this the memory sits idle during most of the arithmetic): `rows` rows of `bytes`
// bytes each, `stride` bytes apart; prefetch() issues the lines of rows [r0, r1), into L2 (kNextChunk)
struct Prefetch {
  const char* base = nullptr;
  int64_t rows = 0, stride = 0, bytes = 0;
  inline void issue(int64_t r0, int64_t r1) const {
    for (int64_t r = r0; r < r1 && r < rows; ++r) {
      const char* p = base + r * stride;
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, kNextChunk);
    }
  }
  // column block blk's share of the next chunk: rows [blk·per, (blk+1)·per). When the rows are contiguous (row
  // stride = row bytes) their lines are handed out (`first`, `lines`) for the tiles to fetch one per row step,
  // spread through the arithmetic; a burst of ~48 lines at once stalls on the core's miss buffers (measured: the
  // slim op at 8k × 8 15.4 vs 20.0 ms, 1k × 1 0.37 vs 0.40 ms). Otherwise they are issued here and lines = 0.
  inline void share(int64_t blk, int64_t per, const char*& first, int64_t& lines) const {
    const int64_t r0 = std::min(rows, blk * per), r1 = std::min(rows, (blk + 1) * per);
    first = base + r0 * stride;
    lines = 0;
    if (stride == bytes)
      lines = ((r1 - r0) * bytes + 63) / 64;
    else
      issue(r0, r1);
  }
  // what the tiles of a block did not fetch: lines [done, lines) from `first`
  static inline void rest(const char* first, int64_t done, int64_t lines) {
    for (; done < lines; ++done) __builtin_prefetch(first + done * 64, 0, kNextChunk);
  }
};

// the lines a tile fetches while it runs m row steps: the `off`-th m of the block's share
inline int64_t tile_lines(int64_t lines, int64_t off, int64_t m) {
  return std::max<int64_t>(0, std::min(m, lines - off));
}

template <int NH, int NV>
inline void accumulate_groups(float* acc, int64_t h, int64_t c, const float* p, int64_t ps, const float* rows,
                              int64_t rs, int64_t m, const Prefetch& pf) {
  const int64_t blocks = std::max<int64_t>(1, c / (NV * V::W));
  const int64_t per_block = (pf.rows + blocks - 1) / blocks;
  int64_t col = 0, blk = 0;
  for (; col + NV * V::W <= c; col += NV * V::W, ++blk) {
    const char* first;
    int64_t lines, off = 0;
    pf.share(blk, per_block, first, lines);
    for (int64_t j = 0; j < h; j += NH, off += m)
      tile<NH, NV>(acc + j * c + col, c, p + j * ps, ps, rows + col, rs, m,
                   lines > off ? first + off * 64 : nullptr, tile_lines(lines, off, m));
    Prefetch::rest(first, off, lines);
  }
  if (blk == 0) pf.issue(0, pf.rows);
  for (; col + V::W <= c; col += V::W)
    for (int64_t j = 0; j < h; j += NH) tile<NH, 1>(acc + j * c + col, c, p + j * ps, ps, rows + col, rs, m);
  for (; col < c; ++col)
    for (int64_t j = 0; j < h; ++j) {
      float s = acc[j * c + col];
      for (int64_t t = 0; t < m; ++t) s += p[j * ps + t] * rows[t * rs + col];
      acc[j * c + col] = s;
    }
}

// acc (h, c) += p (h, m; row stride ps) · rows (m, c; row stride rs); the next chunk's rows are prefetched
// a few rows per column block
inline void accumulate(float* acc, int64_t h, int64_t c, const float* p, int64_t ps, const float* rows, int64_t rs,
                       int64_t m, const Prefetch& pf) {
  // h = 6, 18, ...: one 6-head × 2-vector tile (12 accumulator chains) instead of 4 + 2 heads (the 2-head tile has
  // only 6 chains, too few to hide the FMA latency)
  if (V::W > 1 && h % 4 != 0 && h % 6 == 0) return accumulate_groups<6, 2>(acc, h, c, p, ps, rows, rs, m, pf);
  constexpr int NV = V::W == 1 ? 4 : (V::W == 16 ? 4 : 3);  // columns per tile: NV vectors (4 heads × NV regs)
  const int64_t blocks = std::max<int64_t>(1, c / (NV * V::W));
  const int64_t per_block = (pf.rows + blocks - 1) / blocks;
  int64_t col = 0, blk = 0;
  for (; col + NV * V::W <= c; col += NV * V::W, ++blk) {
    const char* first;
    int64_t lines, off = 0;
    pf.share(blk, per_block, first, lines);
    for (int64_t j = 0; j < h; j += 4, off += m)
      tile_heads<NV>(static_cast<int>(std::min<int64_t>(4, h - j)), acc + j * c + col, c, p + j * ps, ps,
                     rows + col, rs, m, lines > off ? first + off * 64 : nullptr, tile_lines(lines, off, m));
    Prefetch::rest(first, off, lines);
  }
  if (blk == 0) pf.issue(0, pf.rows);
  for (; col + V::W <= c; col += V::W)
    for (int64_t j = 0; j < h; j += 4)
      tile_heads<1>(static_cast<int>(std::min<int64_t>(4, h - j)), acc + j * c + col, c, p + j * ps, ps,
                    rows + col, rs, m);
  for (; col < c; ++col)
    for (int64_t j = 0; j < h; ++j) {
      float s = acc[j * c + col];
      for (int64_t t = 0; t < m; ++t) s += p[j * ps + t] * rows[t * rs + col];
      acc[j * c + col] = s;
    }
}

// softmax step of one head over a chunk: scores sc[0, m) -> probabilities (in place); running (mx, l) and acc
inline void online_softmax(float* sc, int64_t m, float* mx, float* l, float* acc, int64_t c) {
  auto vm = V::set1(-INFINITY);
  int64_t i = 0;
  for (; i + V::W <= m; i += V::W) vm = V::max(vm, V::load(sc + i));
  float cm = V::hmax(vm);
  for (; i < m; ++i) cm = sc[i] > cm ? sc[i] : cm;
  const float nm = cm > *mx ? cm : *mx;
  if (nm == -INFINITY) {  // everything so far is masked with -inf: no weight
    for (i = 0; i < m; ++i) sc[i] = 0.f;
    return;
  }
  if (nm > *mx) {  // the running max grew: rescale what was accumulated (exp(-inf) = 0 on the first chunk)
    const float alpha = *mx == -INFINITY ? 0.f : std::exp(*mx - nm);
    *l *= alpha;
    const auto va = V::set1(alpha);
    int64_t k = 0;
    for (; k + V::W <= c; k += V::W) V::store(acc + k, V::mul(va, V::load(acc + k)));
    for (; k < c; ++k) acc[k] *= alpha;
    *mx = nm;
  }
  const auto vn = V::set1(nm);
  auto vs = V::zero();
  for (i = 0; i + V::W <= m; i += V::W) {
    auto e = V::exp(V::sub(V::load(sc + i), vn));
    V::store(sc + i, e);
    vs = V::add(vs, e);
  }
  float s = V::hsum(vs);
  for (; i < m; ++i) {
    sc[i] = V::W == 1 ? std::exp(sc[i] - nm) : (sc[i] - nm < kvslim_vec::kExpLo ? 0.f : std::exp(sc[i] - nm));
    s += sc[i];
  }
  *l += s;
}

// rows [t0, t1) of sequence b: acc (h, c), running max mx (h), running sum l (h); the caller initialises them
template <class T>
void run_range(const Args& a, int64_t b, int64_t t0, int64_t t1, float* acc, float* mx, float* l,
               Scratch& sp) {
  const T* base = static_cast<const T*>(a.rows) + b * a.bs;
  const float* q = a.q + b * a.qbs;
  const bool raw_rope = a.R > 0 && !a.rotated, rot_rope = a.R > 0 && a.rotated;
  const float* mask = a.mask ? a.mask + b * a.mask_bs : nullptr;
  const float* cosb = a.cos ? a.cos + b * a.cos_bs : nullptr;
  const float* sinb = a.sin ? a.sin + b * a.sin_bs : nullptr;
  for (int64_t cs = t0; cs < t1; cs += sp.T) {
    const int64_t m = std::min<int64_t>(sp.T, t1 - cs);
    // (1) fp32 rows as stored
    const float* src;
    int64_t srs;
    if constexpr (std::is_same<T, float>::value) {
      src = base + cs * a.rs;
      srs = a.rs;
    } else {
      for (int64_t t = 0; t < m; ++t) widen(base + (cs + t) * a.rs, sp.ubuf.data() + t * a.c, a.c);
      src = sp.ubuf.data();
      srs = a.c;
    }
    // (2) scores, all heads
    if (raw_rope)
      scores_rope(q, a.h, a.dk, a.R, src, srs, cosb + cs * a.cos_rs, a.cos_rs, sinb + cs * a.sin_rs, a.sin_rs, m,
                  a.scaling, mask ? mask + cs : nullptr, sp.sc.data(), sp.T);
    else if (a.koff == 0)
      scores_shared(q, a.h, a.L, src, srs, m, a.scaling, mask ? mask + cs : nullptr, sp.sc.data(), sp.T);
    else
      scores(q, a.h, a.koff, a.L, src, srs, m, a.scaling, mask ? mask + cs : nullptr, sp.sc.data(), sp.T);
    // (3) online softmax per head
    for (int64_t j = 0; j < a.h; ++j) online_softmax(sp.sc.data() + j * sp.T, m, mx + j, l + j, acc + j * a.c, a.c);
    // (4) rows for the weighted sum
    const float* urows = src;
    int64_t urs = srs;
    if (rot_rope) {
      float* ub = sp.ubuf.data();
      for (int64_t t = 0; t < m; ++t) {
        const float* row = src + t * srs;
        float* dst = ub + t * a.c;
        if (row != dst)
          for (int64_t k = a.e; k < a.c; ++k) dst[k] = row[k];  // conditioning columns, unrotated
        unrope_row(row, dst, cosb + (cs + t) * a.cos_rs, sinb + (cs + t) * a.sin_rs, a.h, a.dk, a.R);
      }
      urows = ub;
      urs = a.c;
    }
    // (5) acc += p · rows, fetching the next chunk meanwhile
    Prefetch pf;
    if (cs + m < t1) {
      pf.base = reinterpret_cast<const char*>(base + (cs + m) * a.rs);
      pf.rows = std::min<int64_t>(sp.T, t1 - cs - m);
      pf.stride = a.rs * static_cast<int64_t>(sizeof(T));
      pf.bytes = a.c * static_cast<int64_t>(sizeof(T));
    }
    accumulate(acc, a.h, a.c, sp.sc.data(), sp.T, urows, urs, m, pf);
  }
}

// sequence b, split s of S: rows [0, len_b) cut into S pieces aligned to the chunk size
inline void run_task(const Args& a, int64_t b, int64_t s, int64_t S, float* acc, float* mx, float* l,
                     Scratch& sp) {
  const int64_t len = a.lengths ? a.lengths[b] : a.n;
  const int64_t chunks = (len + sp.T - 1) / sp.T, per = (chunks + S - 1) / S;
  const int64_t t0 = std::min(len, s * per * sp.T), t1 = std::min(len, (s + 1) * per * sp.T);
  for (int64_t j = 0; j < a.h; ++j) {
    mx[j] = -INFINITY;
    l[j] = 0.f;
  }
  std::fill(acc, acc + a.h * a.c, 0.f);
  if (t1 <= t0) return;
  if (a.bf16)
    run_range<uint16_t>(a, b, t0, t1, acc, mx, l, sp);
  else
    run_range<float>(a, b, t0, t1, acc, mx, l, sp);
}

// the per-head maps folded into the op (small: h·qdk·L or h·c·odk FMAs per sequence, against the pass over n rows)

// absorbed queries of one sequence: out[j] (L) = Σ_i q[j][i] · M[j][i][:], M (h, qdk, L) contiguous, or
// out[j][x] = q[j] · M[j][x][:] with M (h, L, qdk) (`dk_last`)
inline void absorb_seq(const float* q, const float* M, bool dk_last, int64_t h, int64_t qdk, int64_t L,
                       float* out) {
  for (int64_t j = 0; j < h; ++j) {
    float* o = out + j * L;
    if (dk_last) {  // L dot products of length qdk, four at a time (one transpose-reduce per four outputs)
      dots4(q + j * qdk, M + j * L * qdk, qdk, L, qdk, o);
      continue;
    }
    std::fill(o, o + L, 0.f);
    for (int64_t i = 0; i < qdk; ++i) {
      const auto qb = V::set1(q[j * qdk + i]);
      const float* m = M + (j * qdk + i) * L;
      int64_t k = 0;
      for (; k + V::W <= L; k += V::W) V::store(o + k, V::fma(qb, V::load(m + k), V::load(o + k)));
      for (; k < L; ++k) o[k] += q[j * qdk + i] * m[k];
    }
  }
}

// output of one head: out (odk) = u (c) · M + bias, M (c, odk) (`rows_out` false) or (odk, c) (`rows_out` true)
inline void map_head(const float* u, const float* M, bool rows_out, int64_t c, int64_t odk, const float* bias,
                     float* out) {
  if (rows_out) {  // odk dot products of length c, four at a time
    dots4(u, M, c, odk, c, out);
    if (bias)
      for (int64_t k = 0; k < odk; ++k) out[k] += bias[k];
    return;
  }
  // c rows of M, each scaled by u[x], summed in registers 8 vectors of columns at a time (no store-to-load chain
  // through `out` per row)
  int64_t k = 0;
  for (; k + 8 * V::W <= odk; k += 8 * V::W) {
    typename V::R a[8];
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) a[v] = bias ? V::load(bias + k + v * V::W) : V::zero();
    for (int64_t x = 0; x < c; ++x) {
      const auto ub = V::set1(u[x]);
      const float* m = M + x * odk + k;
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) a[v] = V::fma(ub, V::load(m + v * V::W), a[v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) V::store(out + k + v * V::W, a[v]);
  }
  for (; k + V::W <= odk; k += V::W) {
    auto a = bias ? V::load(bias + k) : V::zero();
    for (int64_t x = 0; x < c; ++x) a = V::fma(V::set1(u[x]), V::load(M + x * odk + k), a);
    V::store(out + k, a);
  }
  for (; k < odk; ++k) {
    float sum = bias ? bias[k] : 0.f;
    for (int64_t x = 0; x < c; ++x) sum += u[x] * M[x * odk + k];
    out[k] = sum;
  }
}
