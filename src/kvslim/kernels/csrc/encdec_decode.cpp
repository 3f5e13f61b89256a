// kvslim::encdec_decode — decoder cross-attention over the shared encoder output E (SPEC §3 "Encoder-decoder"),
// one query token, all heads in one pass over E.
//
//   u[b, j] = softmax_t(scaling · qt[b, j] · E[b, t] + mask[b, t]) · E[b, t]      (B, h, d) fp32
//   lse[b, j] = log Σ_t exp(...)                                                 (B, h)    fp32
//
// qt[b, j] = q[b, j] W_K,jᵀ is the absorbed query (a d-vector per head; the key bias drops out of the softmax).
// The caller applies W_V,j (and b_V,j) to u[b, j]. E (B, n, d) is fp32 or bf16; every size and stride comes
// from tensor metadata and is checked here (named ValueErrors).
#include <torch/library.h>

#include "shared_rows.h"

std::tuple<at::Tensor, at::Tensor> encdec_decode_cpu(const at::Tensor& qt, const at::Tensor& enc,
                                                     const c10::optional<at::Tensor>& mask,
                                                     const c10::optional<at::Tensor>& lengths, double scaling,
                                                     int64_t splits) {
  const char* op = "kvslim::encdec_decode";
  kvslim_rows::Args a;
  at::Tensor e = kvslim_rows::set_rows(a, enc, op, "enc");
  TORCH_CHECK_VALUE(qt.device().is_cpu() && qt.scalar_type() == at::kFloat && qt.dim() == 3 && qt.size(0) == a.B &&
                        qt.size(1) >= 1 && qt.size(2) == a.c,
                    op, ": qt must be float32 (B=", a.B, ", h, d=", a.c, ") on CPU, got ", qt.scalar_type(), " ",
                    qt.sizes());
  at::Tensor qc = qt.contiguous();
  a.q = qc.data_ptr<float>();
  a.h = qc.size(1);
  a.L = a.c;
  a.koff = 0;  // every head scores the whole row
  a.qbs = a.h * a.c;
  a.scaling = static_cast<float>(scaling);
  at::Tensor mk, lk;
  kvslim_rows::set_mask_lengths(a, mask, lengths, mk, lk, op);
  at::Tensor u = at::empty({a.B, a.h, a.c}, qt.options());
  at::Tensor lse = at::empty({a.B, a.h}, qt.options());
  kvslim_rows::run(a, splits, u.data_ptr<float>(), lse.data_ptr<float>());
  return {u, lse};
}

// the same pass with the per-head maps inside the op (one parallel region per layer and step):
//   qt[b, j] = q[b, j] · w_k[j]       q (B, h, dk), w_k (h, dk, d)  (HF k_proj.weight viewed per head)
//   out[b, j] = u[b, j] · w_v[j]ᵀ + b_v[j]   w_v (h, dv, d), b_v (h, dv) or none            -> out (B, h, dv)
// dk_last: the maps come as (h, d, dk) / (h, d, dv) instead (slim's X-cache score_map / value_map), i.e.
//   qt[b, j] = w_k[j] · q[b, j] and out[b, j] = u[b, j] · w_v[j] + b_v[j].
std::tuple<at::Tensor, at::Tensor> encdec_decode_mapped_cpu(const at::Tensor& q, const at::Tensor& enc,
                                                            const at::Tensor& w_k, const at::Tensor& w_v,
                                                            const c10::optional<at::Tensor>& b_v,
                                                            const c10::optional<at::Tensor>& mask,
                                                            const c10::optional<at::Tensor>& lengths,
                                                            double scaling, bool dk_last, int64_t splits) {
  const char* op = "kvslim::encdec_decode_mapped";
  kvslim_rows::Args a;
  at::Tensor e = kvslim_rows::set_rows(a, enc, op, "enc");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(0) == a.B && q.size(1) >= 1 && q.size(2) >= 1, op,
                    ": q must be (B=", a.B, ", h, dk), got ", q.sizes());
  TORCH_CHECK_VALUE(w_v.dim() == 3 && w_v.size(dk_last ? 2 : 1) >= 1, op, ": w_v must be ",
                    dk_last ? "(h, d, dv)" : "(h, dv, d)", ", got ", w_v.sizes());
  a.h = q.size(1);
  a.qdk = q.size(2);
  a.odk = w_v.size(dk_last ? 2 : 1);
  at::Tensor qk, wk, wv, bv, mk, lk;
  a.qraw = kvslim_rows::f32_exact(q, {a.B, a.h, a.qdk}, qk, op, "q");
  if (dk_last) {
    a.absorb = kvslim_rows::f32_exact(w_k, {a.h, a.c, a.qdk}, wk, op, "w_k");
    a.vmap = kvslim_rows::f32_exact(w_v, {a.h, a.c, a.odk}, wv, op, "w_v");
  } else {
    a.absorb = kvslim_rows::f32_exact(w_k, {a.h, a.qdk, a.c}, wk, op, "w_k");
    a.vmap = kvslim_rows::f32_exact(w_v, {a.h, a.odk, a.c}, wv, op, "w_v");
  }
  a.absorb_dk_last = dk_last;
  a.vmap_rows_out = !dk_last;
  if (b_v.has_value()) a.vbias = kvslim_rows::f32_exact(*b_v, {a.h, a.odk}, bv, op, "b_v");
  a.L = a.c;
  a.koff = 0;
  a.scaling = static_cast<float>(scaling);
  kvslim_rows::set_mask_lengths(a, mask, lengths, mk, lk, op);
  at::Tensor out = at::empty({a.B, a.h, a.odk}, q.options());
  at::Tensor lse = at::empty({a.B, a.h}, q.options());
  kvslim_rows::run(a, splits, nullptr, lse.data_ptr<float>(), out.data_ptr<float>());
  return {out, lse};
}

std::string encdec_decode_isa() { return kvslim_rows::isa_name(); }

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("encdec_decode(Tensor qt, Tensor enc, Tensor? mask, Tensor? lengths, float scaling, int splits=0) "
        "-> (Tensor, Tensor)");
  m.def("encdec_decode_mapped(Tensor q, Tensor enc, Tensor w_k, Tensor w_v, Tensor? b_v, Tensor? mask, "
        "Tensor? lengths, float scaling, bool dk_last=False, int splits=0) -> (Tensor, Tensor)");
  m.def("encdec_decode_isa() -> str", &encdec_decode_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("encdec_decode", &encdec_decode_cpu);
  m.impl("encdec_decode_mapped", &encdec_decode_mapped_cpu);
}
