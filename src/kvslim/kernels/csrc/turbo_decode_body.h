// Decode attention over turbo codes, one (sequence, KV head, split) task at a time (no include guard:
// turbo_decode.cpp includes this once per instruction set, inside its namespace with `using V = <traits>`
// (vec_turbo.h) and the matching #pragma GCC target).
//
// Per block of T tokens: (1) scores of the G query heads of the KV group straight from the key codes, NR token
// rows at a time (transpose-reduced), one part after the other into one accumulator per (head, row) (the outlier
// channels at KB + 1 bits, then the rest at KB): q·k_t = q_out · (s_out,t L)[c_out] + q_rest · (s_rest,t L)[c_rest],
// each row's part scales folded into its copy of the codebook, looked up in registers (never decoded into memory);
// plus the optional factored score bias (RoPE-centred keys) into the same accumulators, and the mask; (2) online
// softmax per head (block_softmax_body.h); (3) acc[j] += Σ_t (p_jt s_t) L[c_t] as a register tile over columns, the value
// scale folded into the weight. The fp32 tail (sinks + window) is attended after the codes in the last split, read
// in place (decode_task_body.h's attend_tail, as the int ops; its scale rows, start_task likewise). Every index is
// bounded by TArgs (set from tensor metadata by the op and checked there).

#include "decode_task_body.h"  // parameter rows, the fp32 tail, block_softmax

// acc[j][r] += q_j · (s_r L)[codes_r] over units [u0, u1) of one part (BITS bits, its units at byte `off` +
// (u − u0)·BITS of each row), for HC heads and NR token rows; tb[r]: the part's codebook times row r's part scale.
// ENDS: unit u1 − 1 ends the row
template <int BITS, int HC, int NR, bool ENDS>
inline void part_dots(const uint8_t* const* cr, int64_t off, const Tab<typename V::R>* tb, const float* q, int64_t D,
                      int64_t u0, int64_t u1, typename V::R (&acc)[HC][NR]) {
  const int64_t ue = ENDS ? u1 - 1 : u1;
  for (int64_t u = u0; u < ue; ++u) {
    const int64_t o = off + (u - u0) * BITS;
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const auto x = V::template lut<BITS, false>(cr[r] + o, tb[r]);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) acc[j][r] = V::fma(V::load(q + j * D + 8 * u), x, acc[j][r]);
    }
  }
  if (ENDS) {
    const int64_t o = off + (ue - u0) * BITS;
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const auto x = V::template lut<BITS, true>(cr[r] + o, tb[r]);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) acc[j][r] = V::fma(V::load(q + j * D + 8 * ue), x, acc[j][r]);
    }
  }
}

// acc[j][r] += ab_j · rows_r over W fp32 values (W a multiple of 8), HC heads, NR rows: the factored score bias
template <int HC, int NR>
inline void bias_dots(const float* const* br, const float* ab, int64_t W, typename V::R (&acc)[HC][NR]) {
  for (int64_t i = 0; i < W; i += 8) {
    typename V::R f[HC];
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) f[j] = V::load(ab + j * W + i);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const auto x = V::load(br[r] + i);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) acc[j][r] = V::fma(f[j], x, acc[j][r]);
    }
  }
}

// the codebook t times scale s (the high half only for 4-bit codes, the only ones that read it)
template <int BITS>
inline Tab<typename V::R> scaled(const Tab<typename V::R>& t, float s) {
  const auto f = V::set1(s);
  return {V::mul(t.lo, f), BITS == 4 ? V::mul(t.hi, f) : t.hi};
}

// sc[j·ps + t] = q_j · k_t + ab_j · rows_t + mask_t for coded tokens [t0, t0 + m), heads [j0, j0 + HC) (q and ab
// already times scaling; ab null: no bias). OB: the outlier part's bits (0: no outlier part), KB the rest's. ks: the
// block's key scales (kparts per token), folded into per-row codebooks: both parts and the bias add into one
// accumulator per (head, row), one reduction.
template <int OB, int KB, int HC>
inline void scores_heads(const TArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* q, int64_t j0,
                         const float* ks, const float* ab, const float* mask, float* sc, int64_t ps) {
  const int64_t D = a.D, U = D / 8, UO = a.k_out / 8, ob = a.k_out * OB / 8;
  const int64_t rs = a.k.ts;
  const int kp = OB ? 2 : 1;
  constexpr int NR = HC == 1 ? 8 : 4;
  const Tab<typename V::R> tr = V::template table<KB>(a.lev + KB * 16);
  const Tab<typename V::R> to = V::template table<OB ? OB : KB>(a.lev + (OB ? OB : KB) * 16);
  for (int64_t t = 0; t < m; t += NR) {
    const int64_t rn = std::min<int64_t>(NR, m - t);
    const uint8_t* c0 = a.k.at<uint8_t>(b, h, t0 + t);
    kvslim_decode::prefetch_span(c0 + kvslim_decode::kPrefetchRows * rs, NR * rs);
    const uint8_t* cr[NR];
    Tab<typename V::R> tbo[NR], tbr[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const int64_t rr = r < rn ? r : 0;  // rows past m repeat row 0 (never used)
      cr[r] = c0 + rr * rs;
      const float* s = ks + (t + rr) * kp;
      tbr[r] = scaled<KB>(tr, s[kp - 1]);
      if (OB) tbo[r] = scaled<OB ? OB : KB>(to, s[0]);
    }
    typename V::R acc[HC][NR];
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j)
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[j][r] = V::zero();
    if (OB) part_dots<OB ? OB : 2, HC, NR, false>(cr, 0, tbo, q + j0 * D, D, 0, UO, acc);
    part_dots<KB, HC, NR, true>(cr, ob, tbr, q + j0 * D, D, UO, U, acc);
    if (ab) {
      const float* br[NR];
      for (int r = 0; r < NR; ++r) br[r] = a.bias_rows + (t0 + t + (r < rn ? r : 0)) * a.bias_rs;
      bias_dots<HC, NR>(br, ab + j0 * a.bias_w, a.bias_w, acc);
    }
    float sv[HC][8];
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j)
#pragma GCC unroll 2
      for (int r = 0; r < NR; r += 4) V::hsum4(acc[j][r], acc[j][r + 1], acc[j][r + 2], acc[j][r + 3], sv[j] + r);
    for (int j = 0; j < HC; ++j)
      for (int64_t r = 0; r < rn; ++r) sc[(j0 + j) * ps + t + r] = sv[j][r] + (mask ? mask[t + r] : 0.f);
  }
}

template <int OB, int KB>
inline void code_scores(const TArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* q, const float* ks,
                        const float* ab, const float* mask, float* sc, int64_t ps) {
  int64_t j0 = 0;
  for (; j0 + 3 <= a.G; j0 += 3) scores_heads<OB, KB, 3>(a, b, h, t0, m, q, j0, ks, ab, mask, sc, ps);
  if (a.G - j0 == 2) scores_heads<OB, KB, 2>(a, b, h, t0, m, q, j0, ks, ab, mask, sc, ps);
  if (a.G - j0 == 1) scores_heads<OB, KB, 1>(a, b, h, t0, m, q, j0, ks, ab, mask, sc, ps);
}

// acc[j][c, c + 8·NV) += Σ_t pw[j·pws + t] · L[codes_t][c, c + 8·NV) for HC heads (pw: weight × the row's
// scale; a masked token's is 0 and adds exactly 0: every code looks up a finite level, so no token is tested and
// skipped, which cost more than the lookups it saved). ENDS: the tile's last unit ends the row.
template <int BITS, int NV, int HC, bool ENDS>
inline void value_tile(const uint8_t* base, int64_t rs, int64_t m, const Tab<typename V::R>& tab, const float* pw,
                       int64_t pws, int64_t c, float* acc, int64_t D) {
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
      const auto x = (ENDS && u == NV - 1) ? V::template lut<BITS, true>(ct + u * BITS, tab)
                                           : V::template lut<BITS, false>(ct + u * BITS, tab);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) A[j][u] = V::fma(w[j], x, A[j][u]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) V::store(acc + j * D + c + 8 * v, A[j][v]);
}

template <int BITS, int NV, int HC>
inline void value_tiles(const uint8_t* base, int64_t rs, int64_t m, const Tab<typename V::R>& tab, const float* pw,
                        int64_t pws, float* acc, int64_t D) {
  for (int64_t c = 0; c < D; c += 8 * NV) {
    if (c + 8 * NV == D) value_tile<BITS, NV, HC, true>(base, rs, m, tab, pw, pws, c, acc, D);
    else value_tile<BITS, NV, HC, false>(base, rs, m, tab, pw, pws, c, acc, D);
  }
}

// the widest tile (units of 8 columns) that divides D for HC heads: ≤ 8 for 1 head, ≤ 4 for 2, ≤ 2 for 3
// (registers: HC·NV accumulators + HC weights + the table + loader temporaries ≤ 16)
template <int BITS, int HC>
inline void values_heads(const uint8_t* base, int64_t rs, int64_t m, const Tab<typename V::R>& tab, const float* pw,
                         int64_t pws, float* acc, int64_t D) {
  const int64_t U = D / 8;
  if (HC == 1 && U % 8 == 0) value_tiles<BITS, 8, HC>(base, rs, m, tab, pw, pws, acc, D);
  else if (HC <= 2 && U % 4 == 0) value_tiles<BITS, 4, HC>(base, rs, m, tab, pw, pws, acc, D);
  else if (U % 2 == 0) value_tiles<BITS, 2, HC>(base, rs, m, tab, pw, pws, acc, D);
  else value_tiles<BITS, 1, HC>(base, rs, m, tab, pw, pws, acc, D);
}

// acc[j] += Σ_t p[j][t] s_t L[c_t]; pw: scratch for the weights times the scales
template <int VB>
inline void code_values(const TArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* p, int64_t T,
                        const float* vs, float* pw, float* acc) {
  const int64_t G = a.G, D = a.D;
  for (int64_t j = 0; j < G; ++j) {  // a zero weight never lets its token's scale through (mul_nz)
    const float* pj = p + j * T;
    float* o = pw + j * T;
    int64_t t = 0;
    for (; t + V::W <= m; t += V::W) V::store(o + t, V::mul_nz(V::load(pj + t), V::load(vs + t)));
    for (; t < m; ++t) o[t] = pj[t] == 0.f ? 0.f : pj[t] * vs[t];
  }
  const Tab<typename V::R> tab = V::template table<VB>(a.lev + VB * 16);
  const uint8_t* base = a.v.at<uint8_t>(b, h, t0);
  const int64_t rs = a.v.ts;
  int64_t j0 = 0;
  for (; j0 + 3 <= G; j0 += 3) values_heads<VB, 3>(base, rs, m, tab, pw + j0 * T, T, acc + j0 * D, D);
  if (G - j0 == 2) values_heads<VB, 2>(base, rs, m, tab, pw + j0 * T, T, acc + j0 * D, D);
  if (G - j0 == 1) values_heads<VB, 1>(base, rs, m, tab, pw + j0 * T, T, acc + j0 * D, D);
}

// one task: sequence b, KV head h, split s of S over the coded tokens (the tail goes with the last split).
// acc (G × D) gets the unnormalised sum, mo / lo (G) the running max and denominator.
template <int OB, int KB, int VB>
void run_task(const TArgs& a, int64_t b, int64_t h, int64_t s, int64_t S, float* acc, float* mo, float* lo,
              Scratch& sp) {
  const int64_t G = a.G, D = a.D, T = sp.T;
  float* q = sp.q.data();
  // the sequence's coded tokens: no block past them is read
  const auto task = kvslim_decode::start_task(a, a.lengths ? a.lengths[b] : a.n, b, h, s, S, T, q, acc, mo, lo);
  const float* mask = task.mask;
  float* ab = nullptr;  // the bias factors of the G heads, times scaling (rows read in the task)
  if (a.bias_ab) {
    ab = sp.ab.data();
    const float* src = a.bias_ab + b * a.bias_bs + h * a.bias_hs;
    for (int64_t j = 0; j < G; ++j)
      for (int64_t i = 0; i < a.bias_w; ++i) ab[j * a.bias_w + i] = src[j * a.bias_gs + i] * a.scaling;
  }
  const int64_t kp = OB ? 2 : 1;
  // a page list (sparse decode, decode_common.h): a block never crosses a page; codes, scales and bias rows are read
  // at the stored row r0, the mask at the logical t0
  const int64_t pe = a.sdt == 0 ? 4 : 2;
  const kvslim_decode::Strided bias{a.bias_rows, 0, 0, a.bias_rs};  // (rows, W) fp32: one table for every (b, h)
  const kvslim_decode::Strided* pf[5] = {&a.k, &a.ks, &a.v, &a.vs, &bias};
  const int64_t pf_elem[5] = {1, pe, 1, pe, 4};
  for (int64_t t0 = task.begin; t0 < task.end;) {
    int64_t m = std::min(T, task.end - t0);
    const int64_t r0 = kvslim_decode::paged_block(a.paged, a.Hk, b, h, t0, m);
    KVSLIM_PREFETCH_NEXT_PAGE(a, b, h, t0, m, task.end, pf, pf_elem, 5)  // the next listed page (decode_common.h)
    load_rows(a.ks, a.sdt, b, h, r0, m, kp, sp.ks.data());
    code_scores<OB, KB>(a, b, h, r0, m, q, sp.ks.data(), ab, mask ? mask + t0 : nullptr, sp.sc.data(), T);
    if (block_softmax(sp.sc.data(), T, G, D, m, mo, lo, acc)) {
      load_rows(a.vs, a.sdt, b, h, r0, m, 1, sp.vs.data());
      code_values<VB>(a, b, h, r0, m, sp.sc.data(), T, sp.vs.data(), sp.pw.data(), acc);
    }
    t0 += m;
  }
  if (s == S - 1) attend_tail(a, b, h, q, mask, T, sp.sc.data(), mo, lo, acc, row_scores, row_values);
}

template <int OB, int KB>
inline TaskFn pick_values(int vb) {
  if (vb == 2) return run_task<OB, KB, 2>;
  if (vb == 3) return run_task<OB, KB, 3>;
  return run_task<OB, KB, 4>;
}

inline TaskFn pick(int kb, bool outliers, int vb) {
  if (kb == 2) return outliers ? pick_values<3, 2>(vb) : pick_values<0, 2>(vb);
  if (kb == 3) return outliers ? pick_values<4, 3>(vb) : pick_values<0, 3>(vb);
  return pick_values<0, 4>(vb);
}
