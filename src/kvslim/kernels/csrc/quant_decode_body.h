// Decode attention over grouped int8/int4 codes, one (sequence, KV head, split) task at a time (no include guard:
// quant_decode.cpp includes this once per instruction set, inside its namespace with `using V = <traits>` and the
// matching #pragma GCC target).
//
// Per block of T tokens: (1) the block's key codes are decoded into an L1/L2-resident fp32 scratch (T × D; never
// the history), (2) scores of the G query heads of the KV group, 4 tokens at a time (transpose-reduced), (3) online
// softmax per head (rescale only when the running max grows), (4) the block's value codes decoded the same way,
// (5) acc[j] += p[j][t] · v[t] as a register tile over columns. The fp32 residual window (tail), when given, is
// attended after the codes in the last split, read in place. Every index is bounded by QArgs (set from tensor
// metadata by the op and checked there).

#include "decode_task_body.h"  // parameter rows, the fp32 tail, block_softmax
#include "dots4_body.h"

// one group of `len` codes starting at a group boundary -> fp32 (x = q·s [+ z])
template <int BITS, bool ASYM>
inline void deq_group(const uint8_t* c, float s, float z, float* o, int64_t len) {
  const auto vs = V::set1(s), vz = V::set1(z);
  int64_t i = 0;
  if (BITS == 8) {
    for (; i + V::W <= len; i += V::W) {
      auto x = ASYM ? V::u8(c + i) : V::i8(reinterpret_cast<const int8_t*>(c) + i);
      V::store(o + i, ASYM ? V::fma(x, vs, vz) : V::mul(x, vs));
    }
    for (; i < len; ++i)
      o[i] = ASYM ? static_cast<float>(c[i]) * s + z : static_cast<float>(static_cast<int8_t>(c[i])) * s;
  } else {
    for (; i + 2 * V::W <= len; i += 2 * V::W) {
      typename V::R lo, hi;
      V::template i4<!ASYM>(c + i / 2, lo, hi);
      V::store(o + i, ASYM ? V::fma(lo, vs, vz) : V::mul(lo, vs));
      V::store(o + i + V::W, ASYM ? V::fma(hi, vs, vz) : V::mul(hi, vs));
    }
    for (; i < len; i += 2) {
      float lo, hi;
      kvslim_vec::QuantScalar::template i4<!ASYM>(c + i / 2, lo, hi);
      o[i] = ASYM ? lo * s + z : lo * s;
      o[i + 1] = ASYM ? hi * s + z : hi * s;
    }
  }
}

// one row of D codes with per-channel parameters srow / zrow (D fp32 each; KIVI keys)
template <int BITS, bool ASYM>
inline void deq_channels(const uint8_t* c, const float* srow, const float* zrow, float* o, int64_t D) {
  int64_t i = 0;
  if (BITS == 8) {
    for (; i + V::W <= D; i += V::W) {
      auto x = ASYM ? V::u8(c + i) : V::i8(reinterpret_cast<const int8_t*>(c) + i);
      V::store(o + i, ASYM ? V::fma(x, V::load(srow + i), V::load(zrow + i)) : V::mul(x, V::load(srow + i)));
    }
    for (; i < D; ++i) {
      const float x = ASYM ? static_cast<float>(c[i]) : static_cast<float>(static_cast<int8_t>(c[i]));
      o[i] = ASYM ? x * srow[i] + zrow[i] : x * srow[i];
    }
  } else {
    for (; i + 2 * V::W <= D; i += 2 * V::W) {
      typename V::R lo, hi;
      V::template i4<!ASYM>(c + i / 2, lo, hi);
      const float* s = srow + i;
      const float* z = zrow + i;
      V::store(o + i, ASYM ? V::fma(lo, V::load(s), V::load(z)) : V::mul(lo, V::load(s)));
      V::store(o + i + V::W, ASYM ? V::fma(hi, V::load(s + V::W), V::load(z + V::W)) : V::mul(hi, V::load(s + V::W)));
    }
    for (; i < D; i += 2) {
      float lo, hi;
      kvslim_vec::QuantScalar::template i4<!ASYM>(c + i / 2, lo, hi);
      o[i] = ASYM ? lo * srow[i] + zrow[i] : lo * srow[i];
      o[i + 1] = ASYM ? hi * srow[i + 1] + zrow[i + 1] : hi * srow[i + 1];
    }
  }
}

// tokens [t0, t0 + m) of stream (b, h) -> dst (m × D fp32); `kivi` > 0: per-channel parameters per token group
template <int BITS, bool ASYM>
inline void deq_rows(const QArgs& a, const Codes& st, int64_t kivi, int64_t b, int64_t h, int64_t t0, int64_t m,
                     float* dst, Scratch& sp) {
  const int64_t D = a.D;
  if (kivi > 0) {
    for (int64_t t = t0; t < t0 + m; ++t) {
      const int64_t g = t / kivi;
      if (g != sp.row_group) {  // gather the group's D parameters from its kivi rows of D / kivi values
        const int64_t per = D / kivi;
        for (int64_t r = 0; r < kivi; ++r)
          for (int64_t c = 0; c < per; ++c) {
            sp.srow[r * per + c] = load_param(st.scale, b, h, g * kivi + r, c, a.sdt);
            sp.zrow[r * per + c] = ASYM ? load_param(st.zero, b, h, g * kivi + r, c, a.sdt) : 0.f;
          }
        sp.row_group = g;
      }
      deq_channels<BITS, ASYM>(st.codes.at<uint8_t>(b, h, t), sp.srow.data(), sp.zrow.data(),
                               dst + (t - t0) * D, D);
    }
    return;
  }
  const int64_t gs = a.gs, ng = D / gs;
  for (int64_t t = t0; t < t0 + m; ++t) {
    const uint8_t* c = st.codes.at<uint8_t>(b, h, t);
    float* o = dst + (t - t0) * D;
    for (int64_t g = 0; g < ng; ++g) {
      const float s = load_param(st.scale, b, h, t, g, a.sdt);
      const float z = ASYM ? load_param(st.zero, b, h, t, g, a.sdt) : 0.f;
      deq_group<BITS, ASYM>(c + g * gs * BITS / 8, s, z, o + g * gs, gs);
    }
  }
}

// sc[j·T + t] = q_j · k_t + mask[t] for t < m (q already scaled), 4 tokens per pass (dots4)
inline void block_scores(const float* q, int64_t G, int64_t D, const float* k, int64_t krs, int64_t m,
                         const float* mask, float* sc, int64_t ps) {
  float s[4];
  for (int64_t t = 0; t < m; t += 4) {
    const int64_t r4 = std::min<int64_t>(4, m - t);
    for (int64_t j = 0; j < G; ++j) {
      dots4(q + j * D, k + t * krs, D, r4, krs, s);
      for (int64_t r = 0; r < r4; ++r) sc[j * ps + t + r] = s[r] + (mask ? mask[t + r] : 0.f);
    }
  }
}

// acc[j] += Σ_t p[j][t] · v_t (tokens with weight 0 skipped: a masked row is never read); D a multiple of V::W
inline void block_values(const float* p, int64_t ps, int64_t G, int64_t D, const float* v, int64_t vrs, int64_t m,
                         float* acc) {
  for (int64_t j = 0; j < G; ++j) {
    const float* pj = p + j * ps;
    float* aj = acc + j * D;
    int64_t c = 0;
    for (; c + 4 * V::W <= D; c += 4 * V::W) {
      auto a0 = V::load(aj + c), a1 = V::load(aj + c + V::W), a2 = V::load(aj + c + 2 * V::W),
           a3 = V::load(aj + c + 3 * V::W);
      for (int64_t t = 0; t < m; ++t) {
        if (pj[t] == 0.f) continue;
        const auto w = V::set1(pj[t]);
        const float* vt = v + t * vrs + c;
        a0 = V::fma(w, V::load(vt), a0);
        a1 = V::fma(w, V::load(vt + V::W), a1);
        a2 = V::fma(w, V::load(vt + 2 * V::W), a2);
        a3 = V::fma(w, V::load(vt + 3 * V::W), a3);
      }
      V::store(aj + c, a0);
      V::store(aj + c + V::W, a1);
      V::store(aj + c + 2 * V::W, a2);
      V::store(aj + c + 3 * V::W, a3);
    }
    for (; c < D; c += V::W) {
      auto a0 = V::load(aj + c);
      for (int64_t t = 0; t < m; ++t)
        if (pj[t] != 0.f) a0 = V::fma(V::set1(pj[t]), V::load(v + t * vrs + c), a0);
      V::store(aj + c, a0);
    }
  }
}


// ---- fast path (gs and D multiples of 2W; KIVI keys included): codes converted in registers, never stored.
// A unit is W codes (int8: one vector) or W bytes of int4 codes (2W values: two vectors in chunk order, see
// vec_quant.h i4p). With int4, the query of the scores and the accumulator of the values live in chunk order
// (`perm4`), undone once per task; a code is converted once per pass and used by a chunk of up to 3 query heads.
template <int BITS, bool ASYM>
inline void unit(const uint8_t* c, typename V::R& x0, typename V::R& x1) {
  if (BITS == 8) {
    x0 = ASYM ? V::u8(c) : V::i8(reinterpret_cast<const int8_t*>(c));
  } else {
    V::template i4p<!ASYM>(c, x0, x1);
  }
}

// natural element order <-> chunk order of int4 units: in each chunk of 2W elements, position m < W holds element
// 2m and position W + m element 2m + 1
inline void to_chunk_order(const float* x, float* y, int64_t D) {
  for (int64_t c = 0; c < D; c += 2 * V::W)
    for (int64_t m = 0; m < V::W; ++m) {
      y[c + m] = x[c + 2 * m];
      y[c + V::W + m] = x[c + 2 * m + 1];
    }
}
inline void from_chunk_order(float* x, float* tmp, int64_t D) {
  std::copy(x, x + D, tmp);
  for (int64_t c = 0; c < D; c += 2 * V::W)
    for (int64_t m = 0; m < V::W; ++m) {
      x[c + 2 * m] = tmp[c + m];
      x[c + 2 * m + 1] = tmp[c + V::W + m];
    }
}

#include "qscores_body.h"  // key_rows4 and the integer score path

// scores of 4 tokens (rows cr[0..3], only the first r4 real) for HC query heads (q: HC rows of stride D, chunk
// order for int4) over channels [i0, i1): sv[j][r] = q_j · codes_r (no scales)
template <int BITS, bool ASYM, int HC>
inline void dot4(const uint8_t* const* cr, const float* q, int64_t D, int64_t i0, int64_t i1, float (*sv)[4]) {
  constexpr int64_t U = BITS == 8 ? V::W : 2 * V::W;
  typename V::R acc[HC][4];
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) acc[j][r] = V::zero();
  for (int64_t i = i0; i < i1; i += U) {
    const int64_t off = i * BITS / 8;
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      typename V::R x0, x1;
      unit<BITS, ASYM>(cr[r] + off, x0, x1);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) {
        acc[j][r] = V::fma(V::load(q + j * D + i), x0, acc[j][r]);
        if (BITS == 4) acc[j][r] = V::fma(V::load(q + j * D + i + V::W), x1, acc[j][r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j) V::hsum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3], sv[j]);
}

// sc[j·ps + t] = q_j · k_t (+ mask) for tokens [t0, t0 + m) and heads [j0, j0 + HC): per-token groups (k_t =
// codes·s (+ z)) or KIVI (q already ⊙ the group's scales, zq[j] = q_j · z of the group; all m tokens in one group)
template <int BITS, bool ASYM, int HC, bool KIVI>
inline void scores_heads(const QArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* q, int64_t j0,
                         const float* qsum, const float* zq, const float* ks, const float* kz, const float* mask,
                         float* sc, int64_t ps) {
  const int64_t D = a.D, gs = KIVI ? a.D : a.gs, ng = D / gs;
  for (int64_t t = 0; t < m; t += 4) {
    const uint8_t* cr[4];
    const int64_t r4 = key_rows4(a, b, h, t0, t, m, cr);
    float tot[HC][4] = {};
    for (int64_t g = 0; g < ng; ++g) {
      float sv[HC][4];
      dot4<BITS, ASYM, HC>(cr, q + j0 * D, D, g * gs, (g + 1) * gs, sv);
      for (int j = 0; j < HC; ++j)
        for (int64_t r = 0; r < r4; ++r) tot[j][r] += KIVI ? sv[j][r] : sv[j][r] * ks[(t + r) * ng + g];
    }
    for (int j = 0; j < HC; ++j)
      for (int64_t r = 0; r < r4; ++r) {
        float z = 0.f;
        if (ASYM && KIVI) z = zq[j0 + j];
        if (ASYM && !KIVI)
          for (int64_t g = 0; g < ng; ++g) z += kz[(t + r) * ng + g] * qsum[(j0 + j) * ng + g];
        sc[(j0 + j) * ps + t + r] = tot[j][r] + z + (mask ? mask[t + r] : 0.f);
      }
  }
}

template <int BITS, bool ASYM, bool KIVI>
inline void fast_scores(const QArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* q,
                        const float* qsum, const float* zq, const float* ks, const float* kz, const float* mask,
                        float* sc, int64_t ps) {
  int64_t j0 = 0;
  for (; j0 + 3 <= a.G; j0 += 3)
    scores_heads<BITS, ASYM, 3, KIVI>(a, b, h, t0, m, q, j0, qsum, zq, ks, kz, mask, sc, ps);
  if (a.G - j0 == 2) scores_heads<BITS, ASYM, 2, KIVI>(a, b, h, t0, m, q, j0, qsum, zq, ks, kz, mask, sc, ps);
  if (a.G - j0 == 1) scores_heads<BITS, ASYM, 1, KIVI>(a, b, h, t0, m, q, j0, qsum, zq, ks, kz, mask, sc, ps);
}

// acc[j][c, c + NV·W) += Σ_t pw[j·pws + t] · codes_t[c, c + NV·W) for HC heads (pw: weights × the tile's group
// scale); tokens whose weights are all 0 are skipped (a masked row is never read)
template <int BITS, bool ASYM, int NV, int HC>
inline void value_tile(const uint8_t* base, int64_t rs, int64_t m, const float* pw, int64_t pws, int64_t c,
                       float* acc, int64_t D) {
  constexpr int UV = BITS == 8 ? 1 : 2;  // vectors per unit
  typename V::R A[HC][NV];
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) A[j][v] = V::load(acc + j * D + c + v * V::W);
  const uint8_t* ct = base + c * BITS / 8;
  for (int64_t t = 0; t < m; ++t, ct += rs) {
    __builtin_prefetch(ct + kvslim_decode::kPrefetchRows * rs, 0, 3);
    typename V::R w[HC];
    bool any = false;
#pragma GCC unroll 4
    for (int j = 0; j < HC; ++j) {
      const float x = pw[j * pws + t];
      any |= x != 0.f;
      w[j] = V::set1(x);
    }
    if (!any) continue;
#pragma GCC unroll 8
    for (int u = 0; u < NV / UV; ++u) {
      typename V::R x0, x1;
      unit<BITS, ASYM>(ct + u * UV * V::W * BITS / 8, x0, x1);
#pragma GCC unroll 4
      for (int j = 0; j < HC; ++j) {
        A[j][u * UV] = V::fma(w[j], x0, A[j][u * UV]);
        if (BITS == 4) A[j][u * UV + 1] = V::fma(w[j], x1, A[j][u * UV + 1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < HC; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) V::store(acc + j * D + c + v * V::W, A[j][v]);
}

// the widest tile (vectors) inside one group of gs channels for HC heads: ≤ 8 vectors for 1 head, ≤ 4 for 2-3
inline int tile_vectors(int64_t gs, int hc) {
  const int64_t nv = gs / V::W;  // even (gs a multiple of 2W)
  if (hc == 1 && nv % 8 == 0) return 8;
  return nv % 4 == 0 ? 4 : 2;
}

template <int BITS, bool ASYM, int HC>
inline void values_heads(const QArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* pw, int64_t T,
                         int64_t j0, float* acc) {
  const int64_t D = a.D, gs = a.gs, ng = D / gs;
  const uint8_t* base = a.v.codes.at<uint8_t>(b, h, t0);
  const int64_t rs = a.v.codes.ts;
  const int nv = tile_vectors(gs, HC);
  for (int64_t c = 0; c < D; c += nv * V::W) {
    const float* pg = pw + (j0 * ng + c / gs) * T;  // pw[(j·ng + g)·T + t]
    float* aj = acc + j0 * D;
    if (nv == 8) value_tile<BITS, ASYM, 8, HC>(base, rs, m, pg, ng * T, c, aj, D);
    else if (nv == 4) value_tile<BITS, ASYM, 4, HC>(base, rs, m, pg, ng * T, c, aj, D);
    else value_tile<BITS, ASYM, 2, HC>(base, rs, m, pg, ng * T, c, aj, D);
  }
}

inline bool sp_tokens_ok(const QArgs& a) { return block_tokens(a.D) % 16 == 0; }

// ---- integer values: per head and value group, w_t = p_t · s_{t,g} rounded to uint8 per 16-token sub-block
// (QD::wprep), times the unsigned int4 codes (QD::i4_values, int16 partial sums per sub-block); zero-points in fp32.
// The accumulator then lives in the path's lane order (qv_pos), undone once per task. Python twin:
// quant_decode.int_values_apply / int8_weight_values.
template <int BITS, bool ASYM>
inline bool qv_ok(const QArgs& a) {
  return a.qvals && BITS == 4 && ASYM && a.D % 64 == 0 && a.gs % 64 == 0 && sp_tokens_ok(a);
}

inline void from_qv_order(float* x, float* tmp, int64_t D) {
  std::copy(x, x + D, tmp);
  for (int64_t c = 0; c < D; c += 64)
    for (int64_t i = 0; i < 64; ++i) x[c + i] = tmp[c + QD::qv_pos(i)];
}

template <int HC>
inline void qvalues_heads(const QArgs& a, Scratch& sp, int64_t b, int64_t h, int64_t t0, int64_t m, int64_t T,
                          int64_t j0, float* acc) {
  const int64_t D = a.D, ng = D / a.gs, nsb = T / 16;
  const uint8_t* base = a.v.codes.at<uint8_t>(b, h, t0);
  const int64_t rs = a.v.codes.ts;
  for (int64_t c = 0; c < D; c += 64) {
    const int64_t g = c / a.gs;
    const uint8_t* wq[HC];
    const float* dw[HC];
    float* ac[HC];
    for (int j = 0; j < HC; ++j) {
      wq[j] = sp.wq.data() + ((j0 + j) * ng + g) * T;
      dw[j] = sp.wdw.data() + ((j0 + j) * ng + g) * nsb;
      ac[j] = acc + (j0 + j) * D + c;
    }
    QD::template i4_values<HC>(base, rs, m, c / 2, wq, dw, ac);
  }
}

// the integer value path's weights of one head and one value group per token, whole 16-token sub-blocks only, on a
// path with QD::wprep16 (p ⊙ s and its rounding in one pass); returns the tokens done (0 elsewhere)
template <class Q = QD>  // Q: dependent, so an ISA without wprep16 never instantiates the call
inline int64_t weights16(const float* p, const float* s, int64_t m, uint8_t* wq, float* dw) {
  if constexpr (!Q::kHasScores16) {
    return 0;
  } else {
    int64_t t = 0;
    for (; t + 16 <= m; t += 16) dw[t / 16] = Q::wprep16(p + t, s + t, wq + t);
    return t;
  }
}

// acc[j] += Σ_t p[j][t] · v_t, v_t = codes·s (+ z) decoded in registers (weights folded into the scales)
template <int BITS, bool ASYM>
inline void fast_values(const QArgs& a, int64_t b, int64_t h, int64_t t0, int64_t m, const float* p, int64_t ps,
                        const float* vs, const float* vz, float* pw, float* acc, Scratch& sp, bool qv) {
  const int64_t G = a.G, D = a.D, gs = a.gs, ng = D / gs, T = ps;
  for (int64_t j = 0; j < G; ++j)
    for (int64_t g = 0; g < ng; ++g) {
      float* o = pw + (j * ng + g) * T;
      const float* pj = p + j * ps;
      const int64_t done = qv && ng == 1 ? weights16(pj, vs, m, sp.wq.data() + j * T, sp.wdw.data() + j * (T / 16)) : 0;
      int64_t t = done;
      if (ng == 1)  // one value group per token (the int4 default): the scales are contiguous
        for (; t + V::W <= m; t += V::W) V::store(o + t, V::mul(V::load(pj + t), V::load(vs + t)));
      for (; t < m; ++t) o[t] = pj[t] * vs[t * ng + g];
      if (qv)
        for (int64_t sb = done / 16; sb * 16 < m; ++sb)
          sp.wdw[(j * ng + g) * (T / 16) + sb] =
              QD::wprep(o + sb * 16, std::min<int64_t>(16, m - sb * 16), sp.wq.data() + (j * ng + g) * T + sb * 16);
    }
  int64_t j0 = 0;
  if (qv) {  // QD::kQvHeads heads at a time (AVX2: 2, int16 accumulators of 4 vectors per head; VNNI: 3)
    if constexpr (QD::kQvHeads >= 3)
      for (; j0 + 3 <= G; j0 += 3) qvalues_heads<3>(a, sp, b, h, t0, m, T, j0, acc);
    for (; j0 + 2 <= G; j0 += 2) qvalues_heads<2>(a, sp, b, h, t0, m, T, j0, acc);
    if (G - j0 == 1) qvalues_heads<1>(a, sp, b, h, t0, m, T, j0, acc);
    j0 = G;
  }
  for (; j0 + 3 <= G; j0 += 3) values_heads<BITS, ASYM, 3>(a, b, h, t0, m, pw, T, j0, acc);
  if (G - j0 == 2) values_heads<BITS, ASYM, 2>(a, b, h, t0, m, pw, T, j0, acc);
  if (G - j0 == 1) values_heads<BITS, ASYM, 1>(a, b, h, t0, m, pw, T, j0, acc);
  if (ASYM) {  // Σ_t p_t · z_{t,g} on every channel of group g (chunk order keeps a group's channels together)
    for (int64_t j = 0; j < G; ++j) {
      const float* pj = p + j * ps;
      float* aj = acc + j * D;
      for (int64_t g = 0; g < ng; ++g) {
        float zs = 0.f;
        int64_t t = 0;
        if (ng == 1) {
          auto zv = V::zero();
          for (; t + V::W <= m; t += V::W) zv = V::fma(V::load(pj + t), V::load(vz + t), zv);
          zs = V::hsum(zv);
        }
        for (; t < m; ++t) zs += pj[t] * vz[t * ng + g];
        const auto vz8 = V::set1(zs);
        for (int64_t i = g * gs; i < (g + 1) * gs; i += V::W) V::store(aj + i, V::add(V::load(aj + i), vz8));
      }
    }
  }
}

// the parameters of token group g + 1 into cache while group g is scored (each group's row is read once, so
// without this every group starts with a miss); rows back to back only, never past the coded tokens
inline void prefetch_kivi(const QArgs& a, const Strided& st, int64_t b, int64_t h, int64_t g) {
  if (st.ts != a.D / a.kivi || (g + 2) * a.kivi > a.n) return;
  const char* p = static_cast<const char*>(param_ptr(st, a.sdt, b, h, (g + 1) * a.kivi));
  for (int64_t o = 0; o < a.D * (a.sdt == 0 ? 4 : 2); o += 64) __builtin_prefetch(p + o, 0, 3);
}

template <bool ASYM>
inline void kivi_params(const QArgs& a, int64_t b, int64_t h, int64_t g, float* srow, float* zrow) {
  kivi_row(a, a.k.scale, b, h, g, srow);
  prefetch_kivi(a, a.k.scale, b, h, g);
  if (ASYM) {
    kivi_row(a, a.k.zero, b, h, g, zrow);
    prefetch_kivi(a, a.k.zero, b, h, g);
  } else {
    std::fill(zrow, zrow + a.D, 0.f);
  }
}

template <int BITS>
inline bool fast_ok(const QArgs& a) {
  return a.gs % (2 * V::W) == 0;  // D is a multiple of gs
}

// x (D) := x · M for a row-major D × D M (tmp: D floats)
inline void times_matrix(float* x, const float* M, int64_t D, float* tmp) {
  std::copy(x, x + D, tmp);
  std::fill(x, x + D, 0.f);
  for (int64_t k = 0; k < D; ++k) {
    const auto w = V::set1(tmp[k]);
    const float* row = M + k * D;
    int64_t i = 0;
    for (; i + V::W <= D; i += V::W) V::store(x + i, V::fma(w, V::load(row + i), V::load(x + i)));
    for (; i < D; ++i) x[i] += tmp[k] * row[i];
  }
}

// one task: sequence b, KV head h, split s of S over the coded tokens (the tail goes with the last split, in the
// values' own basis: with a.vunrot the coded sum is rotated back first).
// acc (G × D) gets the unnormalised sum, mo / lo (G) the running max and denominator.
template <int BITS, bool ASYM>
void run_task(const QArgs& a, int64_t b, int64_t h, int64_t s, int64_t S, float* acc, float* mo, float* lo,
              Scratch& sp) {
  const int64_t G = a.G, D = a.D, T = sp.T;
  const auto task =
      kvslim_decode::start_task(a, a.lengths ? a.lengths[b] : a.n, b, h, s, S, T, sp.q.data(), acc, mo, lo);
  const int64_t t_begin = task.begin, t_end = task.end;
  const float* mask = task.mask;
  sp.row_group = -1;
  const bool fast = fast_ok<BITS>(a);
  const bool perm = fast && BITS == 4;  // int4 fast path: query and accumulator in chunk order
  const int64_t ng = D / a.gs;
  float* qk = sp.q.data();  // the query the key codes see (chunk order for int4)
  if (perm) {
    for (int64_t j = 0; j < G; ++j) to_chunk_order(sp.q.data() + j * D, sp.qp.data() + j * D, D);
    qk = sp.qp.data();
  }
  const bool qv = fast && qv_ok<BITS, ASYM>(a);  // integer values (accumulator in the path's lane order)
  const bool qd = qdot_ok(a);  // integer scores (keys read in natural order: no chunk-order query needed)
  if (qd && a.kivi == 0)
    for (int64_t j = 0; j < G; ++j) qdot_prep<BITS, ASYM>(a, sp, j, sp.q.data() + j * D, ng);
  if ((fast || qd) && ASYM && a.kivi == 0) kvslim_decode::group_sums(sp.q.data(), G, D, a.gs, sp.qsum.data());
  // a page list (sparse decode, decode_common.h): a block never crosses a page; every read below takes the stored
  // row r0, the mask and the scores the logical t0
  const int64_t pe = a.sdt == 0 ? 4 : 2;  // bytes per parameter; the tensors a page's prefetch covers:
  const kvslim_decode::Strided* pf[6] = {&a.k.codes, &a.k.scale, &a.k.zero, &a.v.codes, &a.v.scale, &a.v.zero};
  const int64_t pf_elem[6] = {1, pe, pe, 1, pe, pe};
  // a block of up to T logical rows; with a page list on the integer / fast paths it gathers whole pages (parts,
  // each one run of stored rows) so that the softmax runs once per T rows, not once per page; the scores and the
  // value pass still run part by part (one int4 layer at 32k × 8, budget 2,048, warm: 0.87 → 0.83 ms; cold within
  // the noise). The generic path keeps one page per block.
  const bool gather = a.paged.pages && (qd || fast);
  constexpr int kParts = 16;
  int64_t part_r[kParts], part_m[kParts];
  for (int64_t t0 = t_begin; t0 < t_end;) {
    const int64_t mb = std::min(T, t_end - t0);
    int64_t np = 0, mt = 0;  // parts, rows gathered
    do {
      int64_t m = mb - mt;
      part_r[np] = kvslim_decode::paged_block(a.paged, a.Hk, b, h, t0 + mt, m);
      part_m[np++] = m;
      mt += m;
    } while (gather && mt < mb && np < kParts);
    for (int64_t i = 0, o = 0; i < np; o += part_m[i++]) {
      const int64_t r0 = part_r[i], m = part_m[i];
      KVSLIM_PREFETCH_NEXT_PAGE(a, b, h, t0 + o, m, t_end, pf, pf_elem, 6)  // the next listed page (decode_common.h)
      const float* mk = mask ? mask + t0 + o : nullptr;
      float* sc = sp.sc.data() + o;  // this part's scores: columns [o, o + m) of the block's (G, T)
      if (qd && a.kivi == 0) {
        load_params(a, a.k.scale, b, h, r0, m, sp.ks.data());
        if (ASYM) load_params(a, a.k.zero, b, h, r0, m, sp.kz.data());
        qscores<BITS, ASYM, false>(a, sp, b, h, r0, m, sp.qsum.data(), nullptr, sp.ks.data(), sp.kz.data(), mk, sc,
                                   T);
      } else if (qd) {  // KIVI: per token group, the int8 query of q ⊙ s (natural order) and q · z in fp32
        for (int64_t u0 = r0; u0 < r0 + m;) {
          const int64_t g = u0 / a.kivi, u1 = std::min(r0 + m, (g + 1) * a.kivi);
          kivi_params<ASYM>(a, b, h, g, sp.srow.data(), sp.zrow.data());
          kivi_qprep<BITS, ASYM>(a, sp);
          qscores<BITS, ASYM, true>(a, sp, b, h, u0, u1 - u0, nullptr, sp.zq.data(), nullptr, nullptr,
                                    mk ? mk + (u0 - r0) : nullptr, sc + (u0 - r0), T);
          u0 = u1;
        }
      } else if (fast && a.kivi == 0) {
        load_params(a, a.k.scale, b, h, r0, m, sp.ks.data());
        if (ASYM) load_params(a, a.k.zero, b, h, r0, m, sp.kz.data());
        fast_scores<BITS, ASYM, false>(a, b, h, r0, m, qk, sp.qsum.data(), nullptr, sp.ks.data(), sp.kz.data(), mk,
                                       sc, T);
      } else if (fast) {  // KIVI: per token group, the query ⊙ its scales (and q · zeros), then plain dot products
        for (int64_t u0 = r0; u0 < r0 + m;) {
          const int64_t g = u0 / a.kivi, u1 = std::min(r0 + m, (g + 1) * a.kivi);
          kivi_params<ASYM>(a, b, h, g, sp.srow.data(), sp.zrow.data());
          const float* srow = sp.srow.data();
          if (BITS == 4) {  // scales into chunk order, like the query in qk
            to_chunk_order(sp.srow.data(), sp.k.data(), D);
            srow = sp.k.data();
          }
          for (int64_t j = 0; j < G; ++j) {  // qs_j = q_j ⊙ s (the key codes' order), zq_j = q_j · z
            const float* qj = qk + j * D;
            const float* qn = sp.q.data() + j * D;
            float* o = sp.qs.data() + j * D;
            auto z = V::zero();
            for (int64_t i = 0; i < D; i += V::W) {
              V::store(o + i, V::mul(V::load(qj + i), V::load(srow + i)));
              if (ASYM) z = V::fma(V::load(qn + i), V::load(sp.zrow.data() + i), z);
            }
            sp.zq[j] = ASYM ? V::hsum(z) : 0.f;
          }
          const float* qs = sp.qs.data();
          fast_scores<BITS, ASYM, true>(a, b, h, u0, u1 - u0, qs, nullptr, sp.zq.data(), nullptr, nullptr,
                                        mk ? mk + (u0 - r0) : nullptr, sc + (u0 - r0), T);
          u0 = u1;
        }
      } else {  // one part (gather is off): the rows decoded into sp.k
        deq_rows<BITS, ASYM>(a, a.k, a.kivi, b, h, r0, m, sp.k.data(), sp);
        block_scores(sp.q.data(), G, D, sp.k.data(), D, m, mk, sc, T);
      }
    }
    t0 += mt;  // the next block (the reads below use the parts)
    if (!block_softmax(sp.sc.data(), T, G, D, mt, mo, lo, acc)) continue;
    for (int64_t i = 0, o = 0; i < np; o += part_m[i++]) {
      const int64_t r0 = part_r[i], m = part_m[i];
      if (fast) {
        load_params(a, a.v.scale, b, h, r0, m, sp.vs.data());
        if (ASYM) load_params(a, a.v.zero, b, h, r0, m, sp.vz.data());
        fast_values<BITS, ASYM>(a, b, h, r0, m, sp.sc.data() + o, T, sp.vs.data(), sp.vz.data(), sp.pw.data(), acc,
                                sp, qv);
      } else {
        deq_rows<BITS, ASYM>(a, a.v, 0, b, h, r0, m, sp.k.data(), sp);  // values: per-token groups
        block_values(sp.sc.data() + o, T, G, D, sp.k.data(), D, m, acc);
      }
    }
  }
  if (qv)
    for (int64_t j = 0; j < G; ++j) from_qv_order(acc + j * D, sp.srow.data(), D);
  else if (perm)
    for (int64_t j = 0; j < G; ++j) from_chunk_order(acc + j * D, sp.srow.data(), D);
  // value codes in a rotated basis: this split's coded sum back to the values' basis (linear, so it commutes with
  // the online-softmax rescaling and the split merge)
  if (a.vunrot)
    for (int64_t j = 0; j < G; ++j) times_matrix(acc + j * D, a.vunrot, D, sp.zrow.data());
  if (s == S - 1) attend_tail(a, b, h, sp.q.data(), mask, T, sp.sc.data(), mo, lo, acc, block_scores, block_values);
}

inline TaskFn pick(int bits, bool asym) {
  if (bits == 8) return asym ? run_task<8, true> : run_task<8, false>;
  return asym ? run_task<4, true> : run_task<4, false>;
}
