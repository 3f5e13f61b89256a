// What the decode bodies' tasks share, per instruction set (no include guard: a body includes this inside its
// namespace with `using V = <traits>`, once per instruction set; V needs W, load / store / fma / hsum / set1 /
// max / exp (block_softmax_body.h) and params16(p, sdt): W fp16 (sdt 1) or bf16 (sdt 2) parameters -> fp32).
// The instruction-set-free half (task start, split-K driver, merge) is decode_common.h.
//
//   params_f32 / param_ptr / load_rows   fp32 / fp16 / bf16 parameter rows -> fp32 scratch
//   load_params / kivi_row               the same for an op whose Args has D, gs, kivi, sdt (per-token groups,
//                                        KIVI token groups)
//   row_scores / row_values              plain fp32 rows (the tail) against the G query heads
//   attend_tail                          the fp32 tail after a task's codes: scores, online softmax, values
// Used by quant_decode_body.h (int8/int4), quant_decode_lowbit_body.h (2/3-bit) and turbo_decode_body.h (turbo's
// scale rows, task start and fp32 tail).

#include "block_softmax_body.h"

// n parameters at p (sdt 0 fp32, 1 fp16, 2 bf16) -> fp32; n a multiple of V::W or not
inline void params_f32(const void* p, int sdt, float* o, int64_t n) {
  if (sdt == 0) {
    std::memcpy(o, p, n * sizeof(float));
    return;
  }
  const uint16_t* hp = static_cast<const uint16_t*>(p);
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store(o + i, V::params16(hp + i, sdt));
  for (; i < n; ++i) o[i] = sdt == 1 ? kvslim_vec::half_to_f32(hp[i]) : kvslim_vec::bf16_to_f32(hp[i]);
}

inline const void* param_ptr(const kvslim_decode::Strided& st, int sdt, int64_t b, int64_t h, int64_t t) {
  return sdt == 0 ? static_cast<const void*>(st.at<float>(b, h, t)) : static_cast<const void*>(st.at<uint16_t>(b, h, t));
}

// the w parameters of tokens [t0, t0 + m) -> dst[(t − t0)·w + i]
inline void load_rows(const kvslim_decode::Strided& st, int sdt, int64_t b, int64_t h, int64_t t0, int64_t m,
                      int64_t w, float* dst) {
  if (st.ts == w) {  // rows back to back: one run
    params_f32(param_ptr(st, sdt, b, h, t0), sdt, dst, m * w);
    return;
  }
  for (int64_t t = 0; t < m; ++t) params_f32(param_ptr(st, sdt, b, h, t0 + t), sdt, dst + t * w, w);
}

// per-token parameters (D / gs groups a token) of tokens [t0, t0 + m) -> dst[(t − t0)·ng + g]
template <class A>
inline void load_params(const A& a, const kvslim_decode::Strided& st, int64_t b, int64_t h, int64_t t0, int64_t m,
                        float* dst) {
  load_rows(st, a.sdt, b, h, t0, m, a.D / a.gs, dst);
}

// KIVI keys: the D per-channel parameters of token group g (rows [g·kivi, (g+1)·kivi), D/kivi each) -> fp32
template <class A>
inline void kivi_row(const A& a, const kvslim_decode::Strided& st, int64_t b, int64_t h, int64_t g, float* out) {
  const int64_t per = a.D / a.kivi;
  if (st.ts == per) {  // rows back to back: one run of D
    params_f32(param_ptr(st, a.sdt, b, h, g * a.kivi), a.sdt, out, a.D);
    return;
  }
  for (int64_t r = 0; r < a.kivi; ++r) params_f32(param_ptr(st, a.sdt, b, h, g * a.kivi + r), a.sdt, out + r * per, per);
}

// sc[j·ps + t] = q_j · row_t + mask for m fp32 rows (stride rs); D a multiple of V::W
inline void row_scores(const float* q, int64_t G, int64_t D, const float* k, int64_t rs, int64_t m, const float* mask,
                       float* sc, int64_t ps) {
  for (int64_t t = 0; t < m; ++t)
    for (int64_t j = 0; j < G; ++j) {
      auto acc = V::zero();
      for (int64_t i = 0; i < D; i += V::W) acc = V::fma(V::load(q + j * D + i), V::load(k + t * rs + i), acc);
      sc[j * ps + t] = V::hsum(acc) + (mask ? mask[t] : 0.f);
    }
}

// acc[j] += Σ_t p[j][t] · row_t for m fp32 rows (stride rs; a weight of 0 never reads its row); D a multiple of V::W
inline void row_values(const float* p, int64_t ps, int64_t G, int64_t D, const float* v, int64_t rs, int64_t m,
                       float* acc) {
  for (int64_t j = 0; j < G; ++j)
    for (int64_t t = 0; t < m; ++t) {
      const float w = p[j * ps + t];
      if (w == 0.f) continue;
      const auto vw = V::set1(w);
      for (int64_t i = 0; i < D; i += V::W)
        V::store(acc + j * D + i, V::fma(vw, V::load(v + t * rs + i), V::load(acc + j * D + i)));
    }
}

// The fp32 tail (the a.r rows after the a.n coded tokens) of sequence b, KV head h, read in place, in blocks of T:
// scores(q, G, D, k, rs, m, mask, sc, ps) (row_scores or an op's own with that signature), the online softmax, then
// values(p, ps, G, D, v, rs, m, acc). q: the task's scaled query; mask: the sequence's mask row (nullptr: none);
// sc: G × T scratch; mo / lo / acc: the task's running max, denominator and accumulator.
template <class Scores, class Values>
inline void attend_tail(const kvslim_decode::Common& a, int64_t b, int64_t h, const float* q, const float* mask,
                        int64_t T, float* sc, float* mo, float* lo, float* acc, Scores scores, Values values) {
  for (int64_t t0 = 0; t0 < a.r; t0 += T) {
    const int64_t m = std::min(T, a.r - t0);
    scores(q, a.G, a.D, a.kt.at<float>(b, h, t0), a.kt.ts, m, mask ? mask + a.n + t0 : nullptr, sc, T);
    if (!block_softmax(sc, T, a.G, a.D, m, mo, lo, acc)) continue;
    values(sc, T, a.G, a.D, a.vt.at<float>(b, h, t0), a.vt.ts, m, acc);
  }
}
