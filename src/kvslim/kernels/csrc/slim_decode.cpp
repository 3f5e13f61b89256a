// kvslim::slim_decode — slim attention option 2 decode over a K-only cache (SPEC §3), one query token.
//
//   u[b, j] = softmax_t(scaling · q[b, j] · rope(K[b, t, j]) + mask[b, t]) · C[b, t]      (B, h, c) fp32
//   lse[b, j] = log Σ_t exp(...)                                                             (B, h)   fp32
//
// C = the cached rows (B, n, c), fp32 or bf16: h·dk key columns (RoPE "raw": rotated on the fly for the scores;
// "rotated": used as stored for the scores, un-rotated on the fly for u), then c − h·dk conditioning columns.
// All heads share the rows: one pass over C per step. The caller applies W_KV once per head to u.
// Every size and stride comes from tensor metadata and is checked here (named ValueErrors).
#include <torch/library.h>

#include "shared_rows.h"

namespace {

void check_table(const at::Tensor& t, const char* name, int64_t B, int64_t n, int64_t dk) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, "kvslim::slim_decode: ", name,
                    " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 3 && (t.size(0) == 1 || t.size(0) == B) && t.size(1) == n && t.size(2) % 2 == 0 &&
                        t.size(2) > 0 && t.size(2) <= dk,
                    "kvslim::slim_decode: ", name, " must be (1 or B=", B, ", n=", n, ", R) with R even, 0 < R ≤ ",
                    dk, ", got ", t.sizes());
}

// everything but the value map: rows, queries, RoPE table, mask and lengths into `a`; `keep` holds the tensors
// whose pointers `a` uses
void set_slim(kvslim_rows::Args& a, std::vector<at::Tensor>& keep, const at::Tensor& q, const at::Tensor& rows,
              const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
              const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& lengths, double scaling,
              bool rotated, const char* op) {
  keep.resize(6);
  at::Tensor& r = keep[0];
  r = kvslim_rows::set_rows(a, rows, op, "rows");
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.size(0) == a.B &&
                        q.size(1) >= 1 && q.size(2) >= 1,
                    op, ": q must be float32 (B=", a.B, ", h, dk) on CPU, got ", q.scalar_type(), " ", q.sizes());
  const int64_t h = q.size(1), dk = q.size(2);
  TORCH_CHECK_VALUE(h * dk <= a.c, op, ": rows hold c=", a.c, " values per token, fewer than h·dk=", h * dk);
  at::Tensor& qc = keep[1];
  qc = q.contiguous();
  a.q = qc.data_ptr<float>();
  a.h = h;
  a.L = dk;
  a.koff = dk;
  a.qbs = h * dk;
  a.dk = dk;
  a.e = h * dk;
  a.scaling = static_cast<float>(scaling);
  a.rotated = rotated;
  at::Tensor &ck = keep[2], &sk = keep[3], &mk = keep[4], &lk = keep[5];
  TORCH_CHECK_VALUE(cos.has_value() == sin.has_value(), op, ": cos and sin come together");
  if (cos.has_value()) {
    check_table(*cos, "cos", a.B, a.n, dk);
    check_table(*sin, "sin", a.B, a.n, dk);
    TORCH_CHECK_VALUE(cos->sizes() == sin->sizes(), op, ": cos ", cos->sizes(), " and sin ", sin->sizes(),
                      " differ");
    ck = cos->stride(2) == 1 ? *cos : cos->contiguous();
    sk = sin->stride(2) == 1 ? *sin : sin->contiguous();
    a.R = ck.size(2);
    a.cos = ck.data_ptr<float>();
    a.sin = sk.data_ptr<float>();
    a.cos_bs = ck.size(0) == 1 ? 0 : ck.stride(0);
    a.sin_bs = sk.size(0) == 1 ? 0 : sk.stride(0);
    a.cos_rs = ck.stride(1);
    a.sin_rs = sk.stride(1);
  }
  kvslim_rows::set_mask_lengths(a, mask, lengths, mk, lk, op);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> slim_decode_cpu(const at::Tensor& q, const at::Tensor& rows,
                                                   const c10::optional<at::Tensor>& cos,
                                                   const c10::optional<at::Tensor>& sin,
                                                   const c10::optional<at::Tensor>& mask,
                                                   const c10::optional<at::Tensor>& lengths, double scaling,
                                                   bool rotated, int64_t splits) {
  kvslim_rows::Args a;
  std::vector<at::Tensor> keep;
  set_slim(a, keep, q, rows, cos, sin, mask, lengths, scaling, rotated, "kvslim::slim_decode");
  at::Tensor u = at::empty({a.B, a.h, a.c}, q.options());
  at::Tensor lse = at::empty({a.B, a.h}, q.options());
  kvslim_rows::run(a, splits, u.data_ptr<float>(), lse.data_ptr<float>());
  return {u, lse};
}

// the same pass with W_KV applied inside the op: out[b, j] = u[b, j] · value_map[j], value_map (h, c, odk) fp32
std::tuple<at::Tensor, at::Tensor> slim_decode_mapped_cpu(const at::Tensor& q, const at::Tensor& rows,
                                                          const at::Tensor& value_map,
                                                          const c10::optional<at::Tensor>& cos,
                                                          const c10::optional<at::Tensor>& sin,
                                                          const c10::optional<at::Tensor>& mask,
                                                          const c10::optional<at::Tensor>& lengths, double scaling,
                                                          bool rotated, int64_t splits) {
  const char* op = "kvslim::slim_decode_mapped";
  kvslim_rows::Args a;
  std::vector<at::Tensor> keep;
  set_slim(a, keep, q, rows, cos, sin, mask, lengths, scaling, rotated, op);
  TORCH_CHECK_VALUE(value_map.dim() == 3 && value_map.size(2) >= 1, op, ": value_map must be (h, c, odk), got ",
                    value_map.sizes());
  a.odk = value_map.size(2);
  at::Tensor vk;
  a.vmap = kvslim_rows::f32_exact(value_map, {a.h, a.c, a.odk}, vk, op, "value_map");
  at::Tensor out = at::empty({a.B, a.h, a.odk}, q.options());
  at::Tensor lse = at::empty({a.B, a.h}, q.options());
  kvslim_rows::run(a, splits, nullptr, lse.data_ptr<float>(), out.data_ptr<float>());
  return {out, lse};
}

std::string slim_decode_isa() { return kvslim_rows::isa_name(); }

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("slim_decode(Tensor q, Tensor rows, Tensor? cos, Tensor? sin, Tensor? mask, Tensor? lengths, "
        "float scaling, bool rotated, int splits=0) -> (Tensor, Tensor)");
  m.def("slim_decode_mapped(Tensor q, Tensor rows, Tensor value_map, Tensor? cos, Tensor? sin, Tensor? mask, "
        "Tensor? lengths, float scaling, bool rotated, int splits=0) -> (Tensor, Tensor)");
  m.def("slim_decode_isa() -> str", &slim_decode_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) {
  m.impl("slim_decode", &slim_decode_cpu);
  m.impl("slim_decode_mapped", &slim_decode_mapped_cpu);
}
