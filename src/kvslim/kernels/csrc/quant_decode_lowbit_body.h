// Decode attention over asymmetric 2-bit / 3-bit codes, one (sequence, KV head, split) task at a time (no include
// guard: quant_decode_lowbit.cpp includes this once per instruction set, inside its namespace with `using V =
// <traits>` (vec_lowbit.h) and the matching #pragma GCC target).
//
// Per block of T tokens: (1) scores of the G query heads of the KV group straight from the key codes, 4 tokens at
// a time (transpose-reduced): KIVI keys (per-channel scale s and zero z over token groups) as
// q·k_t = (q ⊙ s)·c_t + q·z with q ⊙ s and q·z formed once per token group; per-token keys as
// Σ_g s_tg (q_g·c_tg) + z_tg Σ q_g; (2) online softmax per head (rescale only when the running max grows);
// (3) acc[j] += Σ_t p_jt (s_tg c_t + z_tg) as a register tile over columns, p_jt·s_tg folded into the weight and
// Σ_t p_jt z_tg added per group once per block. Codes are converted in registers, never stored; a unit's lane j
// comes scaled by 2^(BITS·j) (vec_lowbit.h): the query the key codes see carries 2^(−KB·j), and the value
// accumulator runs in the scaled basis until the task's codes are done (zero-point sums added scaled). The fp32 tail
// (residual window) is attended after the codes in the last split, read in place. Every index is bounded by
// LArgs (set from tensor metadata by the op and checked there).

#include "decode_task_body.h"  // parameter rows, the fp32 tail, block_softmax

// sv[j][r] = q_j · codes_r over units [u0, u1) of 8 channels, for HC heads (q rows of stride D) and NR (4 or 8)
// token rows cr[0..NR); `ends`: unit u1 − 1 is the last of the row (loaded from its end). HC·NR independent
// accumulator chains hide the FMA latency (one head: 8 token rows).
template <int BITS, int HC, int NR>
inline void dot_rows(const uint8_t* const* cr, const float* q, int64_t D, int64_t u0, int64_t u1, bool ends,
                     float (*sv)[8]) {
  typename V::R acc[HC][NR];
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[j][r] = V::zero();
  const int64_t ue = ends ? u1 - 1 : u1;
  for (int64_t u = u0; u < ue; ++u) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const auto x = V::template unit<BITS, false>(cr[r] + u * BITS);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) acc[j][r] = V::fma(V::load(q + j * D + 8 * u), x, acc[j][r]);
    }
  }
  if (ends) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const auto x = V::template unit<BITS, true>(cr[r] + ue * BITS);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) acc[j][r] = V::fma(V::load(q + j * D + 8 * ue), x, acc[j][r]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 2
    for (int r = 0; r < NR; r += 4) V::hsum4(acc[j][r], acc[j][r + 1], acc[j][r + 2], acc[j][r + 3], sv[j] + r);
}

// sc[j·ps + t] = q_j · k_t + mask for tokens [t0, t0 + m), heads [j0, j0 + HC). KIVI: q = q ⊙ s of the tokens'
// group, zq[j] = q_j · z. Per-token keys: ks/kz the tokens' parameters, qsum[j·ng + g] = Σ_{i∈g} q_j[i].
template <int BITS, int HC, bool KIVI>
inline void scores_heads(const LArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* q, int64_t j0,
                         const float* qsum, const float* zq, const float* ks, const float* kz, const float* mask,
                         float* sc, int64_t ps) {
  const int64_t D = a.D, U = D / 8, ng = KIVI ? 1 : D / a.gs, gu = KIVI ? U : a.gs / 8;
  const int64_t rs = a.k.codes.ts;
  constexpr int NR = HC == 1 ? 8 : 4;  // token rows per pass
  for (int64_t t = 0; t < m; t += NR) {
    const int64_t r4 = std::min<int64_t>(NR, m - t);
    const uint8_t* c0 = a.k.codes.at<uint8_t>(b, h, t0 + t);
    kvslim_decode::prefetch_span(c0 + kvslim_decode::kPrefetchRows * rs, NR * rs);
    const uint8_t* cr[NR];
    for (int r = 0; r < NR; ++r) cr[r] = r < r4 ? c0 + r * rs : c0;  // rows past m repeat row 0 (never used)
    float tot[HC][NR] = {};
    for (int64_t g = 0; g < ng; ++g) {
      float sv[HC][8];
      dot_rows<BITS, HC, NR>(cr, q + j0 * D, D, g * gu, (g + 1) * gu, g == ng - 1, sv);
      for (int j = 0; j < HC; ++j)
        for (int64_t r = 0; r < r4; ++r) tot[j][r] += KIVI ? sv[j][r] : sv[j][r] * ks[(t + r) * ng + g];
    }
    for (int j = 0; j < HC; ++j)
      for (int64_t r = 0; r < r4; ++r) {
        float z = 0.f;
        if (KIVI) z = zq[j0 + j];
        else
          for (int64_t g = 0; g < ng; ++g) z += kz[(t + r) * ng + g] * qsum[(j0 + j) * ng + g];
        sc[(j0 + j) * ps + t + r] = tot[j][r] + z + (mask ? mask[t + r] : 0.f);
      }
  }
}

template <int BITS, bool KIVI>
inline void code_scores(const LArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* q,
                        const float* qsum, const float* zq, const float* ks, const float* kz, const float* mask,
                        float* sc, int64_t ps) {
  int64_t j0 = 0;
  for (; j0 + 3 <= a.G; j0 += 3) scores_heads<BITS, 3, KIVI>(a, b, h, t0, m, q, j0, qsum, zq, ks, kz, mask, sc, ps);
  if (a.G - j0 == 2) scores_heads<BITS, 2, KIVI>(a, b, h, t0, m, q, j0, qsum, zq, ks, kz, mask, sc, ps);
  if (a.G - j0 == 1) scores_heads<BITS, 1, KIVI>(a, b, h, t0, m, q, j0, qsum, zq, ks, kz, mask, sc, ps);
}

// acc[j][c, c + 8·NV) += Σ_t pw[j·pws + t] · codes_t[c, c + 8·NV) for HC heads. A masked token's weight is +0
// (mul_nz: its scale, which may be NaN, never gets in) and its codes are finite integers, so it adds exactly 0: no
// token is tested and skipped (as turbo's value tile). ENDS: the tile's last unit ends the row.
template <int BITS, int NV, int HC, bool ENDS>
inline void value_tile(const uint8_t* base, int64_t rs, int64_t m, const float* pw, int64_t pws, int64_t c,
                       float* acc, int64_t D) {
  typename V::R A[HC][NV];
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) A[j][v] = V::load(acc + j * D + c + 8 * v);
  const uint8_t* ct = base + (c / 8) * BITS;
  for (int64_t t = 0; t < m; ++t, ct += rs) {
    __builtin_prefetch(ct + kvslim_decode::kPrefetchRows * rs, 0, 3);
    typename V::R w[HC];
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) w[j] = V::set1(pw[j * pws + t]);
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) {
      const auto x = (ENDS && u == NV - 1) ? V::template unit<BITS, true>(ct + u * BITS)
                                           : V::template unit<BITS, false>(ct + u * BITS);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) A[j][u] = V::fma(w[j], x, A[j][u]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) V::store(acc + j * D + c + 8 * v, A[j][v]);
}

// the widest tile (units of 8 columns) inside one group of gs channels for HC heads: ≤ 8 for 1 head, ≤ 4 for 2,
// ≤ 2 for 3 (registers: HC·NV accumulators + HC weights + loader temporaries ≤ 16)
inline int tile_units(int64_t gs, int hc) {
  const int64_t nu = gs / 8;  // even (gs a multiple of 16)
  if (hc == 1 && nu % 8 == 0) return 8;
  if (hc <= 2 && nu % 4 == 0) return 4;
  return 2;
}

template <int BITS, int NV, int HC>
inline void value_tile_at(const uint8_t* base, int64_t rs, int64_t m, const float* pw, int64_t pws, int64_t c,
                          float* acc, int64_t D) {
  if (c + 8 * NV == D) value_tile<BITS, NV, HC, true>(base, rs, m, pw, pws, c, acc, D);
  else value_tile<BITS, NV, HC, false>(base, rs, m, pw, pws, c, acc, D);
}

template <int BITS, int HC>
inline void values_heads(const LArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* pw, int64_t T,
                         int64_t j0, float* acc) {
  const int64_t D = a.D, gs = a.gs, ng = D / gs;
  const uint8_t* base = a.v.codes.at<uint8_t>(b, h, t0);
  const int64_t rs = a.v.codes.ts;
  const int nv = tile_units(gs, HC);
  for (int64_t c = 0; c < D; c += 8 * nv) {
    const float* pg = pw + (j0 * ng + c / gs) * T;  // pw[(j·ng + g)·T + t]
    float* aj = acc + j0 * D;
    if (nv == 8) value_tile_at<BITS, 8, HC>(base, rs, m, pg, ng * T, c, aj, D);
    else if (nv == 4) value_tile_at<BITS, 4, HC>(base, rs, m, pg, ng * T, c, aj, D);
    else value_tile_at<BITS, 2, HC>(base, rs, m, pg, ng * T, c, aj, D);
  }
}

// acc[j] += Σ_t p[j][t] · (codes_t · s_t + z_t) (per-token groups; weights folded into the scales; a weight of 0
// never touches its token's parameters, which may hold anything)
template <int BITS>
inline void code_values(const LArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* p, int64_t T,
                        const float* vs, const float* vz, float* pw, float* acc) {
  const int64_t G = a.G, D = a.D, gs = a.gs, ng = D / gs;
  const auto lanes = V::template lanes<BITS, 1>();
  for (int64_t j = 0; j < G; ++j) {
    const float* pj = p + j * T;
    for (int64_t g = 0; g < ng; ++g) {
      float* o = pw + (j * ng + g) * T;
      float zs = 0.f;
      int64_t t = 0;
      if (ng == 1) {
        auto zv = V::zero();
        for (; t + V::W <= m; t += V::W) {
          const auto x = V::load(pj + t);
          V::store(o + t, V::mul_nz(x, V::load(vs + t)));
          zv = V::add(zv, V::mul_nz(x, V::load(vz + t)));
        }
        zs = V::hsum(zv);
      }
      for (; t < m; ++t) {
        const float x = pj[t];
        o[t] = x == 0.f ? 0.f : x * vs[t * ng + g];
        zs += x == 0.f ? 0.f : x * vz[t * ng + g];
      }
      const auto vzs = V::mul(V::set1(zs), lanes);  // Σ_t p_t · z_tg on every channel of group g (scaled basis)
      float* aj = acc + j * D + g * gs;
      for (int64_t i = 0; i < gs; i += V::W) V::store(aj + i, V::add(V::load(aj + i), vzs));
    }
  }
  int64_t j0 = 0;
  for (; j0 + 3 <= G; j0 += 3) values_heads<BITS, 3>(a, b, h, t0, m, pw, T, j0, acc);
  if (G - j0 == 2) values_heads<BITS, 2>(a, b, h, t0, m, pw, T, j0, acc);
  if (G - j0 == 1) values_heads<BITS, 1>(a, b, h, t0, m, pw, T, j0, acc);
}

// one task: sequence b, KV head h, split s of S over the coded tokens (the tail goes with the last split).
// acc (G × D) gets the unnormalised sum, mo / lo (G) the running max and denominator.
template <int KB, int VB, bool KIVI>
void run_task(const LArgs& a, int64_t b, int64_t h, int64_t s, int64_t S, float* acc, float* mo, float* lo,
              Scratch& sp) {
  const int64_t G = a.G, D = a.D, T = sp.T;
  float* q = sp.q.data();
  const auto task = kvslim_decode::start_task(a, a.lengths ? a.lengths[b] : a.n, b, h, s, S, T, q, acc, mo, lo);
  const int64_t t_begin = task.begin, t_end = task.end;
  const float* mask = task.mask;
  const auto kdown = V::template lanes<KB, -1>();  // the key units' lane factors, undone on the query
  if (!KIVI) {
    kvslim_decode::group_sums(q, G, D, a.gs, sp.qsum.data());
    for (int64_t i = 0; i < G * D; i += V::W) V::store(sp.qs.data() + i, V::mul(V::load(q + i), kdown));
  }
  int64_t row_group = -1;
  // a page list (sparse decode, decode_common.h): a block never crosses a page; every read below takes the stored
  // row r0, the mask and the scores the logical t0
  const int64_t pe = a.sdt == 0 ? 4 : 2;  // bytes per parameter; the tensors a page's prefetch covers:
  const kvslim_decode::Strided* pf[6] = {&a.k.codes, &a.k.scale, &a.k.zero, &a.v.codes, &a.v.scale, &a.v.zero};
  const int64_t pf_elem[6] = {1, pe, pe, 1, pe, pe};
  for (int64_t t0 = t_begin; t0 < t_end;) {
    int64_t m = std::min(T, t_end - t0);
    const int64_t r0 = kvslim_decode::paged_block(a.paged, a.Hk, b, h, t0, m);
    KVSLIM_PREFETCH_NEXT_PAGE(a, b, h, t0, m, t_end, pf, pf_elem, 6)  // the next listed page (decode_common.h)
    const float* mk = mask ? mask + t0 : nullptr;
    if (KIVI) {  // per token group: q ⊙ its scales and q · its zeros, then plain dot products with the codes
      for (int64_t u0 = r0; u0 < r0 + m;) {
        const int64_t g = u0 / a.kivi, u1 = std::min(r0 + m, (g + 1) * a.kivi);
        if (g != row_group) {
          kivi_row(a, a.k.scale, b, h, g, sp.srow.data());
          kivi_row(a, a.k.zero, b, h, g, sp.zrow.data());
          for (int64_t j = 0; j < G; ++j) {
            auto z = V::zero();
            for (int64_t i = 0; i < D; i += V::W) {
              const auto qv = V::load(q + j * D + i);
              V::store(sp.qs.data() + j * D + i, V::mul(V::mul(qv, V::load(sp.srow.data() + i)), kdown));
              z = V::fma(qv, V::load(sp.zrow.data() + i), z);
            }
            sp.zq[j] = V::hsum(z);
          }
          row_group = g;
        }
        code_scores<KB, true>(a, b, h, u0, u1 - u0, sp.qs.data(), nullptr, sp.zq.data(), nullptr, nullptr,
                              mk ? mk + (u0 - r0) : nullptr, sp.sc.data() + (u0 - r0), T);
        u0 = u1;
      }
    } else {
      load_params(a, a.k.scale, b, h, r0, m, sp.ks.data());
      load_params(a, a.k.zero, b, h, r0, m, sp.kz.data());
      code_scores<KB, false>(a, b, h, r0, m, sp.qs.data(), sp.qsum.data(), nullptr, sp.ks.data(), sp.kz.data(),
                             mk, sp.sc.data(), T);
    }
    t0 += m;  // the next block (the reads below use r0 and m)
    if (!block_softmax(sp.sc.data(), T, G, D, m, mo, lo, acc)) continue;
    load_params(a, a.v.scale, b, h, r0, m, sp.vs.data());
    load_params(a, a.v.zero, b, h, r0, m, sp.vz.data());
    code_values<VB>(a, b, h, r0, m, sp.sc.data(), T, sp.vs.data(), sp.vz.data(), sp.pw.data(), acc);
  }
  const auto vdown = V::template lanes<VB, -1>();  // the accumulator back to the values' basis (exact)
  for (int64_t i = 0; i < G * D; i += V::W) V::store(acc + i, V::mul(V::load(acc + i), vdown));
  if (s == S - 1) attend_tail(a, b, h, q, mask, T, sp.sc.data(), mo, lo, acc, row_scores, row_values);
}

inline TaskFn pick(int kb, int vb, bool kivi) {
#define KVSLIM_LOWBIT_PICK(K, VV)                                  \
  if (kb == K && vb == VV) return kivi ? run_task<K, VV, true> : run_task<K, VV, false>;
  KVSLIM_LOWBIT_PICK(3, 2)
  KVSLIM_LOWBIT_PICK(2, 2)
  KVSLIM_LOWBIT_PICK(3, 3)
  KVSLIM_LOWBIT_PICK(2, 3)
#undef KVSLIM_LOWBIT_PICK
  return nullptr;
}
