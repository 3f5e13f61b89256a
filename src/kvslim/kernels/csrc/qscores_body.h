// The score helpers of the int8/int4 decode op: the key rows of 4 tokens (key_rows4, used by the fp32 and the
// integer score loops) and the integer score path (query prep: the int8 query of q or of q ⊙ s per KIVI token
// group; the score loops). quant_decode_body.h includes this once per instruction set, inside its namespace (no
// include guard); it needs only QArgs / Scratch (quant_decode.cpp), V / QD and decode_common.h, never a function
// of the body. The Python twin is quant_decode.int_scores_apply / int8_query_scores.

// the key code rows of tokens [t, t + 4) of stream (b, h) from token t0 (rows past m repeat the first: computed on,
// never stored), with the rows kPrefetchRows ahead fetched; returns how many of the 4 are real
inline int64_t key_rows4(const QArgs& a, int64_t b, int64_t h, int64_t t0, int64_t t, int64_t m,
                         const uint8_t** cr) {
  const int64_t r4 = std::min<int64_t>(4, m - t), rs = a.k.codes.ts;
  const uint8_t* c0 = a.k.codes.at<uint8_t>(b, h, t0 + t);
  kvslim_decode::prefetch_span(c0 + kvslim_decode::kPrefetchRows * rs, 4 * rs);
  for (int r = 0; r < 4; ++r) cr[r] = r < r4 ? c0 + r * rs : c0;
  return r4;
}

// ---- integer scores: the query the key codes see (q, or q ⊙ s per KIVI token group), rounded to int8 per block of
// 32 channels (vec_quant.h qprep), times the codes in integer arithmetic (QD::i4x4 / i8x4); zero-points, the token
// scales and the signed-int4 offset in fp32. The Python twin (quant_decode.int_scores_apply) mirrors this rule.
inline bool qdot_ok(const QArgs& a) {
  if (!a.qdot) return false;
  const int64_t gk = a.kivi ? a.D : a.gs;  // channels one key parameter set covers per token
  if (a.bits == 4) return a.D % 64 == 0 && gk % 64 == 0;
  return !a.asym && a.D % 32 == 0 && gk % 32 == 0;
}

// the int8 query of head j from u (D floats); signed int4: corr[j·ng + g] = −8 · Σ_{b∈g} d_b Σ_{i∈b} u8_i
template <int BITS, bool ASYM>
inline void qdot_prep(const QArgs& a, Scratch& sp, int64_t j, const float* u, int64_t ng) {
  const int64_t D = a.D, nb = D / 32, bpg = nb / ng;
  QD::qprep(u, D, sp.q8.data() + j * D, sp.qe.data() + j * D / 2, sp.qo.data() + j * D / 2, sp.qd.data() + j * nb,
            BITS == 4 ? sp.qdx.data() + j * (D / 8) : nullptr, BITS == 4 && !ASYM ? sp.qbs.data() + j * nb : nullptr);
  for (int64_t g = 0; g < ng; ++g) {
    float c = 0.f;
    if (BITS == 4 && !ASYM)
      for (int64_t bk = g * bpg; bk < (g + 1) * bpg; ++bk)
        c -= 8.f * sp.qd[j * nb + bk] * static_cast<float>(sp.qbs[j * nb + bk]);
    sp.corr[j * ng + g] = c;
  }
}

// the KIVI query prep of run_task for int4 asymmetric keys of head dim 64 on a path with QD::qprep64: q_j ⊙ s kept in
// registers and rounded there (the same codes, scales and q·z as the general loop); false: not this case
template <int BITS, bool ASYM, class Q = QD>  // Q: dependent, so an ISA without qprep64 never instantiates the body
inline bool kivi_prep64(const QArgs& a, Scratch& sp) {
  if constexpr (!(Q::kHasScores16 && BITS == 4 && ASYM)) {
    return false;
  } else {
    if (a.D != 64) return false;
    const float *s = sp.srow.data(), *zr = sp.zrow.data();
    for (int64_t j = 0; j < a.G; ++j) {
      const float* qn = sp.q.data() + j * 64;
      typename V::R u[4];
      auto z = V::zero();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        u[i] = V::mul(V::load(qn + 16 * i), V::load(s + 16 * i));
        z = V::fma(V::load(qn + 16 * i), V::load(zr + 16 * i), z);
      }
      Q::qprep64(u, sp.qe.data() + j * 32, sp.qo.data() + j * 32, sp.qd.data() + j * 2, sp.qdx.data() + j * 8);
      sp.corr[j] = 0.f;
      sp.zq[j] = V::hsum(z);
    }
    return true;
  }
}

// KIVI integer scores: per head, the int8 query of q ⊙ s for the token group's scales (srow) and zq = q · z (zrow)
template <int BITS, bool ASYM>
inline void kivi_qprep(const QArgs& a, Scratch& sp) {
  if (kivi_prep64<BITS, ASYM>(a, sp)) return;
  const int64_t D = a.D;
  for (int64_t j = 0; j < a.G; ++j) {
    const float* qn = sp.q.data() + j * D;
    float* o = sp.qs.data() + j * D;
    auto z = V::zero();
    for (int64_t i = 0; i < D; i += V::W) {
      V::store(o + i, V::mul(V::load(qn + i), V::load(sp.srow.data() + i)));
      if (ASYM) z = V::fma(V::load(qn + i), V::load(sp.zrow.data() + i), z);
    }
    qdot_prep<BITS, ASYM>(a, sp, j, o, 1);
    sp.zq[j] = (ASYM ? V::hsum(z) : 0.f);
  }
}

// qscores_heads for int4 KIVI keys of head dim 64 (one 64-channel chunk per row; SmolLM2, Qwen2.5-0.5B, ...): with
// VNNI 16 tokens per pass (QD::scores16_64, rows transposed in registers); the rest 4 at a time with the HC heads'
// query bytes and block scales loaded into registers once for the token group, and no group loop. The same
// integer sums and float operations either way: the same scores.
template <bool ASYM, int HC, class Q = QD>  // Q: dependent, so an ISA without i4x4_64 never instantiates this
inline void qscores_kivi64(const QArgs& a, const Scratch& sp, int64_t b, int64_t h, int64_t t0, int64_t m,
                           int64_t j0, const float* zq, const float* mask, float* sc, int64_t ps) {
  using kvslim_vec::F4;
  float corr[HC], z[HC];
  for (int j = 0; j < HC; ++j) {
    corr[j] = sp.corr[j0 + j];
    z[j] = ASYM ? zq[j0 + j] : 0.f;
  }
  int64_t t = 0;
  if constexpr (Q::kHasScores16)  // 16 tokens per pass, sums per token without a horizontal reduction
    for (; t + 16 <= m; t += 16)
      Q::template scores16_64<HC, !ASYM, ASYM>(a.k.codes.at<uint8_t>(b, h, t0 + t), a.k.codes.ts,
                                               sp.qe.data() + j0 * 32, sp.qo.data() + j0 * 32,
                                               sp.qd.data() + j0 * 2, corr, z, mask ? mask + t : nullptr,
                                               sc + j0 * ps + t, ps);
  if (t == m) return;
  __m256i e[HC], o[HC];
  __m256 dx[HC];
  for (int j = 0; j < HC; ++j) {
    e[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp.qe.data() + (j0 + j) * 32));
    o[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp.qo.data() + (j0 + j) * 32));
    dx[j] = _mm256_loadu_ps(sp.qdx.data() + (j0 + j) * 8);
  }
  for (; t < m; t += 4) {
    const uint8_t* cr[4];
    const int64_t r4 = key_rows4(a, b, h, t0, t, m, cr);
    F4 sv[HC];
    Q::template i4x4_64<HC, !ASYM>(cr, e, o, dx, sv);
    F4 m4 = {0.f, 0.f, 0.f, 0.f};
    if (mask)
      for (int64_t r = 0; r < r4; ++r) m4[r] = mask[t + r];
    for (int j = 0; j < HC; ++j) {
      F4 tot = F4{0.f, 0.f, 0.f, 0.f};  // qscores_heads' expression with its KIVI scale 1, kept bit for bit
      tot += (sv[j] + corr[j]) * F4{1.f, 1.f, 1.f, 1.f};
      F4 zz = m4;
      if (ASYM) zz += z[j];
      const F4 res = tot + zz;
      float* out = sc + (j0 + j) * ps + t;
      if (r4 == 4) std::memcpy(out, &res, sizeof(res));
      else
        for (int64_t r = 0; r < r4; ++r) out[r] = res[r];
    }
  }
}

// sc[j·ps + t] for tokens [t0, t0 + m), heads [j0, j0 + HC) from the int8 query in sp: per-token key groups
// (Σ_g s_{t,g} · dot_g + zero-points) or KIVI (dot + zq[j]; all m tokens in one token group)
template <int BITS, bool ASYM, int HC, bool KIVI>
inline void qscores_heads(const QArgs& a, const Scratch& sp, int64_t b, int64_t h, int64_t t0, int64_t m,
                          int64_t j0, const float* qsum, const float* zq, const float* ks, const float* kz,
                          const float* mask, float* sc, int64_t ps) {
  if constexpr (BITS == 4 && KIVI && QD::kHasI4x4_64) {
    if (a.D == 64) return qscores_kivi64<ASYM, HC>(a, sp, b, h, t0, m, j0, zq, mask, sc, ps);
  }
  const int64_t D = a.D, gs = KIVI ? a.D : a.gs, ng = D / gs;
  const int8_t *qe[HC], *qo[HC], *q8[HC];
  const float* dq[HC];
  for (int j = 0; j < HC; ++j) {
    qe[j] = sp.qe.data() + (j0 + j) * D / 2;
    qo[j] = sp.qo.data() + (j0 + j) * D / 2;
    q8[j] = sp.q8.data() + (j0 + j) * D;
    dq[j] = BITS == 4 ? sp.qdx.data() + (j0 + j) * (D / 8) : sp.qd.data() + (j0 + j) * (D / 32);
  }
  using kvslim_vec::F4;
  for (int64_t t = 0; t < m; t += 4) {
    const uint8_t* cr[4];
    const int64_t r4 = key_rows4(a, b, h, t0, t, m, cr);
    // lanes r ≥ r4 compute on a repeated row and are never stored; the token tables (ks, kz) hold T ≥ t + 4 rows
    F4 tot[HC];
    for (int j = 0; j < HC; ++j) tot[j] = F4{0.f, 0.f, 0.f, 0.f};
    for (int64_t g = 0; g < ng; ++g) {
      F4 sv[HC];
      if (BITS == 4) QD::template i4x4<HC, !ASYM>(cr, g * gs, (g + 1) * gs, qe, qo, dq, sv);
      else QD::template i8x4<HC>(cr, g * gs, (g + 1) * gs, q8, dq, sv);
      F4 s4 = {1.f, 1.f, 1.f, 1.f};
      if (!KIVI) s4 = F4{ks[t * ng + g], ks[(t + 1) * ng + g], ks[(t + 2) * ng + g], ks[(t + 3) * ng + g]};
      for (int j = 0; j < HC; ++j) tot[j] += (sv[j] + sp.corr[(j0 + j) * ng + g]) * s4;
    }
    F4 m4 = {0.f, 0.f, 0.f, 0.f};
    if (mask)
      for (int64_t r = 0; r < r4; ++r) m4[r] = mask[t + r];
    for (int j = 0; j < HC; ++j) {
      F4 z = m4;
      if (ASYM && KIVI) z += zq[j0 + j];
      if (ASYM && !KIVI)
        for (int64_t g = 0; g < ng; ++g)
          z += F4{kz[t * ng + g], kz[(t + 1) * ng + g], kz[(t + 2) * ng + g], kz[(t + 3) * ng + g]} *
               qsum[(j0 + j) * ng + g];
      const F4 res = tot[j] + z;
      float* o = sc + (j0 + j) * ps + t;
      if (r4 == 4) std::memcpy(o, &res, sizeof(res));
      else
        for (int64_t r = 0; r < r4; ++r) o[r] = res[r];
    }
  }
}

template <int BITS, bool ASYM, bool KIVI>
inline void qscores(const QArgs& a, const Scratch& sp, int64_t b, int64_t h, int64_t t0, int64_t m,
                    const float* qsum, const float* zq, const float* ks, const float* kz, const float* mask, float* sc,
                    int64_t ps) {
  int64_t j0 = 0;
  for (; j0 + 3 <= a.G; j0 += 3)
    qscores_heads<BITS, ASYM, 3, KIVI>(a, sp, b, h, t0, m, j0, qsum, zq, ks, kz, mask, sc, ps);
  if (a.G - j0 == 2) qscores_heads<BITS, ASYM, 2, KIVI>(a, sp, b, h, t0, m, j0, qsum, zq, ks, kz, mask, sc, ps);
  if (a.G - j0 == 1) qscores_heads<BITS, ASYM, 1, KIVI>(a, sp, b, h, t0, m, j0, qsum, zq, ks, kz, mask, sc, ps);
}
