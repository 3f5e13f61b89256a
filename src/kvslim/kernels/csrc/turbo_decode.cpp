// kvslim::turbo_decode — decode attention (one query token) straight from TurboQuant-class codes (turbo2/3/4,
// kvslim/ops/turbo.py, caches/turbo.py).
//
//   out[b, h, j] = Σ_t softmax_t(scaling · (q[b, h, j] · k_t + ab[b, h, j] · rows[t]) + mask[b, t]) · v_t  (B, Hk, G, D)
//   lse[b, h, j] = log Σ_t exp(...)                                                                    (B, Hk, G)
//
// over the first lengths[b] coded tokens (≤ n; all n without lengths; no block past them is read; with a page list
// `pages` (B, Hk, k) and `page`, sparse decode's: the n rows are logical, row t stored at pages[b, h, t / page]·page
// + t % page, read in place, bias rows by stored row), then the r
// rows of an optional fp32 tail (no bias there). Everything is in the stores' coded bases: the caller rotates
// (and permutes) the query and the tail into them and rotates the output back once. A coded key row: channels
// [0, k_out) at k_bits + 1 bits, the rest at k_bits, each part with its own scale (k_scale (B, Hk, T, parts));
// k_t[i] = scale[part(i)] · levels[bits(i)][code_i]. A value row: v_bits bits,
// one scale. Codes: little-endian bit streams per row (kvslim's packing: code i at bits [b·i, b·i + b) of the row;
// the outlier part first, the rest from byte k_out·(k_bits + 1)/8). levels: (5, 16) fp32, row b the 2^b levels of
// the b-bit codebook. Scales fp32, fp16 or bf16. Optional factored score bias on the coded rows: bias_ab fp32
// (B, Hk, G, W) and bias_rows fp32 (≥ n, W), W a multiple of 8 (RoPE-centred keys: q·RoPE_t(μ) = a·cos(tθ) +
// b·sin(tθ), one table of the positions for every sequence and head; caches/turbo.TurboStore.bias_factors).
// The G query heads of a KV head share one pass over its codes, the codebook is looked up in registers
// (vec_turbo.h), blocks of 128 tokens with an online softmax, parallel over batch × KV heads × splits of the
// sequence (flash-decoding, exact log-sum-exp merge; decode_common.h). AVX2 + FMA + F16C or scalar (the same body
// on plain 8-float arrays), chosen at run time (KVSLIM_ISA=scalar or turbo_decode_set_isa caps it). Head dim and
// k_out must be multiples of 8 (the Python dispatch takes other widths to the pure-torch twin). Every size comes
// from tensor metadata and is checked (named ValueErrors).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "decode_common.h"
#include "sparse_select_body.h"
#include "vec_turbo.h"

#pragma GCC visibility push(hidden)

namespace kvslim_turbo {

using kvslim_decode::Strided;

struct TArgs : kvslim_decode::Common {
  int64_t k_out = 0;
  int sdt = 0;  // scale dtype: 0 fp32, 1 fp16, 2 bf16
  const float* lev = nullptr;  // (5, 16)
  Strided k, v, ks, vs;
  const float* bias_ab = nullptr;  // (B, Hk, G, W), unit last stride
  int64_t bias_bs = 0, bias_hs = 0, bias_gs = 0, bias_w = 0;
  const float* bias_rows = nullptr;  // (≥ n, W), unit last stride (with a page list: ≥ the stored rows)
  int64_t bias_rs = 0;
  kvslim_decode::PageList paged;  // sparse decode's page list (decode_common.h; none: row t is row t)
};

struct Scratch {
  int64_t T;
  std::vector<float> q, sc, pw, ks, vs, ab;
  Scratch(const TArgs& a, int64_t T_)
      : T(T_), q(a.G * a.D), sc(a.G * T_), pw(a.G * T_), ks(2 * T_), vs(T_), ab(a.G * a.bias_w) {}
};

using TaskFn = void (*)(const TArgs&, int64_t, int64_t, int64_t, int64_t, float*, float*, float*, Scratch&);

constexpr int64_t kBlock = 128;  // tokens per block

}  // namespace kvslim_turbo

namespace kvslim_turbo {
namespace scalar {
using V = TurboScalar;
#include "turbo_decode_body.h"
}  // namespace scalar
}  // namespace kvslim_turbo

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvslim_turbo {
namespace avx2 {
using V = TurboAVX2;
#include "turbo_decode_body.h"
}  // namespace avx2
}  // namespace kvslim_turbo
#pragma GCC pop_options

namespace kvslim_turbo {

constexpr const char* kOp = "kvslim::turbo_decode";

// the path in force: AVX2 + FMA + F16C when the CPU has them, capped to scalar by KVSLIM_ISA=scalar or
// turbo_decode_set_isa
inline kvslim_decode::Avx2OrScalar& isa_switch() {
  static kvslim_decode::Avx2OrScalar sw;
  return sw;
}

inline std::string cpu_isa() { return isa_switch().isa(); }

std::tuple<at::Tensor, at::Tensor> turbo_decode(const at::Tensor& q_in, const at::Tensor& k_codes,
                                                const at::Tensor& k_scale, const at::Tensor& v_codes,
                                                const at::Tensor& v_scale, int64_t k_out, int64_t k_bits,
                                                int64_t v_bits, const at::Tensor& levels_in, int64_t n,
                                                const c10::optional<at::Tensor>& k_tail,
                                                const c10::optional<at::Tensor>& v_tail,
                                                const c10::optional<at::Tensor>& mask_in, double scaling,
                                                const c10::optional<at::Tensor>& bias_ab,
                                                const c10::optional<at::Tensor>& bias_rows, int64_t splits,
                                                const c10::optional<at::Tensor>& lengths,
                                                const c10::optional<at::Tensor>& pages_in, int64_t page,
    const c10::optional<at::Tensor>& sel_q, const c10::optional<at::Tensor>& boxes,
    const c10::optional<at::Tensor>& box_scales, int64_t sel_pages, int64_t sel_k, bool sel_force, int64_t sel_rest,
    const c10::optional<at::Tensor>& chosen) {
  TArgs a;
  TORCH_CHECK_VALUE(q_in.dim() == 4 && q_in.device().is_cpu(), kOp, ": q must be a (B, Hk, G, D) CPU tensor, got ",
                    q_in.sizes(), " on ", q_in.device());
  const at::Tensor q = q_in.to(at::kFloat);
  kvslim_decode::read_query_shape(kOp, a, q);
  const int64_t D = a.D;
  TORCH_CHECK_VALUE(D % 8 == 0, kOp, ": the head dimension must be a multiple of 8, got ", D);
  TORCH_CHECK_VALUE(k_bits >= 2 && k_bits <= 4 && v_bits >= 2 && v_bits <= 4, kOp,
                    ": k_bits and v_bits must be 2, 3 or 4, got ", k_bits, ", ", v_bits);
  TORCH_CHECK_VALUE(k_out >= 0 && k_out < D && k_out % 8 == 0 && (k_out == 0 || k_bits < 4), kOp,
                    ": k_out must be a multiple of 8 in [0, D) and 0 with 4-bit keys, got ", k_out);
  TORCH_CHECK_VALUE(n >= 0, kOp, ": n must be >= 0, got ", n);
  a.n = n;
  a.k_out = k_out;
  const int64_t kbytes = (k_out * (k_bits + 1) + (D - k_out) * k_bits) / 8, vbytes = D * v_bits / 8;
  const int64_t kparts = k_out ? 2 : 1;
  TORCH_CHECK_VALUE(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte, kOp,
                    ": codes must be uint8");
  // a page list: the n rows are logical, every listed page a whole page of the rows every coded tensor holds
  const int64_t stored = std::min({k_codes.dim() == 4 ? k_codes.size(2) : 0, v_codes.dim() == 4 ? v_codes.size(2) : 0,
                                   k_scale.dim() == 4 ? k_scale.size(2) : 0, v_scale.dim() == 4 ? v_scale.size(2) : 0});
  const c10::optional<at::Tensor> pages = kvslim_select::in_call(kOp, pages_in, sel_q, boxes, box_scales, sel_pages,
                                                                  sel_k, sel_force, sel_rest, chosen, scaling);
  a.paged = kvslim_decode::bind_pages(kOp, pages, page, a.B, a.Hk, n, 0, stored);
  const int64_t min_rows = a.paged.pages ? 0 : n;
  TORCH_CHECK_VALUE(!a.paged.pages || !(lengths.has_value() && lengths->defined()), kOp,
                    ": pages and lengths do not go together");
  kvslim_decode::check_4d(kOp, k_codes, "k_codes", a.B, a.Hk, min_rows, kbytes);
  kvslim_decode::check_4d(kOp, v_codes, "v_codes", a.B, a.Hk, min_rows, vbytes);
  kvslim_decode::check_4d(kOp, k_scale, "k_scale", a.B, a.Hk, min_rows, kparts);
  kvslim_decode::check_4d(kOp, v_scale, "v_scale", a.B, a.Hk, min_rows, 1);
  TORCH_CHECK_VALUE(k_scale.scalar_type() == v_scale.scalar_type(), kOp, ": k_scale and v_scale must share a dtype");
  a.sdt = kvslim_decode::param_code(kOp, k_scale.scalar_type());
  const at::Tensor levels = levels_in.to(at::kFloat).contiguous();
  TORCH_CHECK_VALUE(levels.dim() == 2 && levels.size(0) == 5 && levels.size(1) == 16, kOp,
                    ": levels must be (5, 16), got ", levels.sizes());
  a.lev = levels.data_ptr<float>();
  const at::Tensor kc = kvslim_decode::unit_last(k_codes), vc = kvslim_decode::unit_last(v_codes),
                   ks = kvslim_decode::unit_last(k_scale), vs = kvslim_decode::unit_last(v_scale);
  a.k = kvslim_decode::strided(kc);
  a.v = kvslim_decode::strided(vc);
  a.ks = kvslim_decode::strided(ks);
  a.vs = kvslim_decode::strided(vs);
  c10::optional<at::Tensor> kt, vt, mask;
  if (k_tail.has_value() && k_tail->defined()) kt = k_tail->to(at::kFloat);
  if (v_tail.has_value() && v_tail->defined()) vt = v_tail->to(at::kFloat);
  if (mask_in.has_value() && mask_in->defined()) mask = mask_in->to(at::kFloat);
  c10::optional<at::Tensor> lens;
  if (lengths.has_value() && lengths->defined()) lens = *lengths;
  const kvslim_decode::Held held = kvslim_decode::bind_common(kOp, a, q, scaling, lens, kt, vt, mask);
  at::Tensor ab, rows;
  const bool has_ab = bias_ab.has_value() && bias_ab->defined(), has_rows = bias_rows.has_value() && bias_rows->defined();
  TORCH_CHECK_VALUE(has_ab == has_rows, kOp, ": bias_ab and bias_rows come together");
  if (has_ab) {
    const auto& f = *bias_ab;
    TORCH_CHECK_VALUE(f.device().is_cpu() && f.scalar_type() == at::kFloat && f.dim() == 4 && f.size(0) == a.B &&
                          f.size(1) == a.Hk && f.size(2) == a.G && f.size(3) % 8 == 0 && f.size(3) > 0,
                      kOp, ": bias_ab must be float32 (B=", a.B, ", Hk=", a.Hk, ", G=", a.G,
                      ", W a positive multiple of 8) on CPU, got ", f.scalar_type(), " ", f.sizes());
    const auto& t = *bias_rows;
    const int64_t need = a.paged.pages ? stored / page * page : n;  // rows a read can reach
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) >= need &&
                          t.size(1) == f.size(3),
                      kOp, ": bias_rows must be float32 (>=", need, " rows, W=", f.size(3), ") on CPU, got ",
                      t.scalar_type(), " ", t.sizes());
    ab = f.stride(3) == 1 ? f : f.contiguous();
    rows = t.stride(1) == 1 ? t : t.contiguous();
    a.bias_ab = ab.data_ptr<float>();
    a.bias_bs = ab.stride(0);
    a.bias_hs = ab.stride(1);
    a.bias_gs = ab.stride(2);
    a.bias_w = ab.size(3);
    a.bias_rows = rows.data_ptr<float>();
    a.bias_rs = rows.stride(0);
  }
  at::Tensor out = at::empty({a.B, a.Hk, a.G, D}, q.options()), lse = at::empty({a.B, a.Hk, a.G}, q.options());
  kvslim_select::write_chosen(chosen, pages);  // every check passed
  if (a.B * a.Hk * a.G == 0) return {out, lse};
  const bool outl = k_out > 0;
  const int kb = static_cast<int>(k_bits), vb = static_cast<int>(v_bits);
  const TaskFn fn = cpu_isa() == "avx2" ? avx2::pick(kb, outl, vb) : scalar::pick(kb, outl, vb);
  kvslim_decode::run_split_k<Scratch>(a, splits, kBlock, fn, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

}  // namespace kvslim_turbo

std::string turbo_decode_isa() { return kvslim_turbo::cpu_isa(); }

// select the path ("avx2" or "scalar"; tests run both in one process); returns the previous one
std::string turbo_decode_set_isa(const std::string& isa) {
  return kvslim_turbo::isa_switch().set("kvslim::turbo_decode_set_isa", isa);
}

#pragma GCC visibility pop

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("turbo_decode(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, int k_out, "
        "int k_bits, int v_bits, Tensor levels, int n, Tensor? k_tail, Tensor? v_tail, Tensor? mask, "
        "float scaling, Tensor? bias_ab=None, Tensor? bias_rows=None, int splits=0, Tensor? lengths=None, "
        "Tensor? pages=None, int page=0, Tensor? sel_q=None, Tensor? boxes=None, Tensor? box_scales=None, int sel_pages=0, int sel_k=0, bool sel_force=False, int sel_rest=0, Tensor(a!)? chosen=None) -> (Tensor, Tensor)");
  m.def("turbo_decode_isa() -> str", &turbo_decode_isa);
  m.def("turbo_decode_set_isa(str isa) -> str", &turbo_decode_set_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("turbo_decode", &kvslim_turbo::turbo_decode); }
