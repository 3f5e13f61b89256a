// kvslim::quant_decode_lowbit — decode attention (one query token) straight from asymmetric 2-bit / 3-bit KV codes
// (the `int2` method: 3-bit KIVI keys + 2-bit values by default).
//
//   out[b, h, j] = Σ_t softmax_t(scaling · q[b, h, j] · k[b, h, t] + mask[b, t]) · v[b, h, t]     (B, Hk, G, D) fp32
//   lse[b, h, j] = log Σ_t exp(...)                                                                 (B, Hk, G)    fp32
//
// over tokens t = the first lengths[b] (≤ n) coded tokens, then the r rows of an optional fp32 tail (the residual
// window kept in full precision). Codes as kvslim's stores keep them (ops/quant_formats.py): unsigned,
// x = q·s + z; 2 bits: 4 codes per byte, code 4i + j at bits [2j, 2j+2) of byte i; 3 bits: 8 codes per 3 bytes,
// code 8i + j at bits [3j, 3j+3) of the little-endian 24-bit word. Key and value bits are independent (2 or 3).
// Scales / zero-points fp32, fp16 or bf16: values per token over groups of `group_size` channels; keys the same,
// or with key_channel_group = g > 0 (KIVI) per channel over token groups of g, group i's D parameters laid over
// scale rows [i·g, (i+1)·g) (D/g per row).
// The G query heads of a KV head (GQA / MQA: HF's repeat_kv order) share one pass over its codes; no
// full-precision copy of the history is made (codes are converted in registers). Parallel over batch × KV heads ×
// splits of the sequence (flash-decoding, exact log-sum-exp merge). AVX2 + FMA + F16C or scalar, chosen at run
// time (KVSLIM_ISA=scalar or quant_decode_lowbit_set_isa caps it). Every size and stride comes from tensor metadata and is checked here (named
// ValueErrors); no code row is read past its end (vec_lowbit.h).
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
#include "vec_lowbit.h"

#pragma GCC visibility push(hidden)

namespace kvslim_lowbit {

using kvslim_decode::Codes;
using kvslim_decode::Strided;

struct LArgs : kvslim_decode::Common {
  int kb = 3, vb = 2;
  int64_t gs = 0, kivi = 0;
  int sdt = 0;  // parameter dtype: 0 fp32, 1 fp16, 2 bf16
  Codes k, v;
  kvslim_decode::PageList paged;  // sparse decode's page list (decode_common.h; none: row t is row t)
};

struct Scratch {
  int64_t T;
  std::vector<float> q, qs, zq, sc, pw, srow, zrow, qsum, ks, kz, vs, vz;
  Scratch(const LArgs& a, int64_t T_)
      : T(T_), q(a.G * a.D), qs(a.G * a.D), zq(a.G), sc(a.G * T_), pw(a.G * (a.D / a.gs) * T_), srow(a.D),
        zrow(a.D), qsum(a.G * (a.D / a.gs)), ks(T_ * (a.D / a.gs)), kz(T_ * (a.D / a.gs)), vs(T_ * (a.D / a.gs)),
        vz(T_ * (a.D / a.gs)) {}
};

using TaskFn = void (*)(const LArgs&, int64_t, int64_t, int64_t, int64_t, float*, float*, float*, Scratch&);

constexpr int64_t kBlock = 128;  // tokens per block

}  // namespace kvslim_lowbit

namespace kvslim_lowbit {
namespace scalar {
using V = LowScalar;
#include "quant_decode_lowbit_body.h"
}  // namespace scalar
}  // namespace kvslim_lowbit

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvslim_lowbit {
namespace avx2 {
using V = LowAVX2;
#include "quant_decode_lowbit_body.h"
}  // namespace avx2
}  // namespace kvslim_lowbit
#pragma GCC pop_options

namespace kvslim_lowbit {

// the path in force: AVX2 + FMA + F16C when the CPU has them, capped to scalar by KVSLIM_ISA=scalar or
// quant_decode_lowbit_set_isa
inline kvslim_decode::Avx2OrScalar& isa_switch() {
  static kvslim_decode::Avx2OrScalar sw;
  return sw;
}

inline std::string cpu_isa() { return isa_switch().isa(); }

void run(const LArgs& a, int64_t S, float* out, float* lse) {
  const TaskFn fn = cpu_isa() == "avx2" ? avx2::pick(a.kb, a.vb, a.kivi > 0) : scalar::pick(a.kb, a.vb, a.kivi > 0);
  kvslim_decode::run_split_k<Scratch>(a, S, kBlock, fn, out, lse);
}

// ---- argument checks (named ValueErrors) -------------------------------------------------------------------

constexpr const char* OP = "kvslim::quant_decode_lowbit";

using kvslim_decode::strided;
using kvslim_decode::unit_last;

void check_4d(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t min_tokens, int64_t width) {
  kvslim_decode::check_4d(OP, t, name, B, H, min_tokens, width);
}

}  // namespace kvslim_lowbit

std::tuple<at::Tensor, at::Tensor> quant_decode_lowbit_cpu(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& k_zero,
    const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero, int64_t k_bits, int64_t v_bits,
    int64_t group_size, int64_t key_channel_group, int64_t n, const c10::optional<at::Tensor>& lengths,
    const c10::optional<at::Tensor>& k_tail, const c10::optional<at::Tensor>& v_tail,
    const c10::optional<at::Tensor>& mask, double scaling, int64_t splits, const c10::optional<at::Tensor>& pages_in,
    int64_t page,
    const c10::optional<at::Tensor>& sel_q, const c10::optional<at::Tensor>& boxes,
    const c10::optional<at::Tensor>& box_scales, int64_t sel_pages, int64_t sel_k, bool sel_force, int64_t sel_rest,
    const c10::optional<at::Tensor>& chosen) {
  using namespace kvslim_lowbit;
  LArgs a;
  kvslim_decode::read_query_shape(OP, a, q);
  TORCH_CHECK_VALUE(a.D >= 16 && a.D % 16 == 0, OP, ": the head dimension must be a positive multiple of 16, got ",
                    a.D);
  TORCH_CHECK_VALUE(k_bits == 2 || k_bits == 3, OP, ": k_bits must be 2 or 3, got ", k_bits);
  TORCH_CHECK_VALUE(v_bits == 2 || v_bits == 3, OP, ": v_bits must be 2 or 3, got ", v_bits);
  a.kb = static_cast<int>(k_bits);
  a.vb = static_cast<int>(v_bits);
  TORCH_CHECK_VALUE(group_size >= 16 && group_size % 16 == 0 && a.D % group_size == 0, OP, ": group_size=",
                    group_size, " must be a multiple of 16 that divides the head dimension ", a.D);
  a.gs = group_size;
  TORCH_CHECK_VALUE(key_channel_group >= 0 && (key_channel_group == 0 || a.D % key_channel_group == 0), OP,
                    ": key_channel_group=", key_channel_group, " must be 0 or divide the head dimension ", a.D);
  a.kivi = key_channel_group;
  TORCH_CHECK_VALUE(n >= 0, OP, ": n must be ≥ 0, got ", n);
  a.n = n;
  const c10::optional<at::Tensor> pages = kvslim_select::in_call(OP, pages_in, sel_q, boxes, box_scales, sel_pages,
                                                                  sel_k, sel_force, sel_rest, chosen, scaling);
  a.paged = kvslim_decode::bind_pages(OP, pages, page, a.B, a.Hk, n, a.kivi, std::min(k_codes.size(2),
                                                                                      v_codes.size(2)));
  const int64_t rows = a.paged.pages ? 0 : n;  // a page list: its own check above
  check_4d(k_codes, "k_codes", a.B, a.Hk, rows, a.D * k_bits / 8);
  check_4d(v_codes, "v_codes", a.B, a.Hk, rows, a.D * v_bits / 8);
  TORCH_CHECK_VALUE(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte, OP,
                    ": codes must be uint8, got ", k_codes.scalar_type(), " / ", v_codes.scalar_type());
  const int64_t kparams = a.kivi ? a.D / a.kivi : a.D / a.gs;
  const int64_t ktokens = a.paged.pages ? k_codes.size(2) / page * page
                                         : a.kivi ? (n + a.kivi - 1) / a.kivi * a.kivi : n;
  check_4d(k_scale, "k_scale", a.B, a.Hk, ktokens, kparams);
  check_4d(k_zero, "k_zero", a.B, a.Hk, ktokens, kparams);
  check_4d(v_scale, "v_scale", a.B, a.Hk, a.paged.pages ? ktokens : n, a.D / a.gs);
  check_4d(v_zero, "v_zero", a.B, a.Hk, a.paged.pages ? ktokens : n, a.D / a.gs);
  a.sdt = kvslim_decode::param_code(OP, k_scale.scalar_type());
  for (const at::Tensor* t : {&k_zero, &v_scale, &v_zero})
    TORCH_CHECK_VALUE(t->scalar_type() == k_scale.scalar_type(), OP,
                      ": scales and zero-points must share one dtype, got ", k_scale.scalar_type(), " and ",
                      t->scalar_type());
  at::Tensor kc = unit_last(k_codes), vc = unit_last(v_codes), ks = unit_last(k_scale), vs = unit_last(v_scale),
             kz = unit_last(k_zero), vz = unit_last(v_zero);
  a.k = Codes{strided(kc), strided(ks), strided(kz)};
  a.v = Codes{strided(vc), strided(vs), strided(vz)};
  const kvslim_decode::Held held = kvslim_decode::bind_common(OP, a, q, scaling, lengths, k_tail, v_tail, mask);
  at::Tensor out = at::empty({a.B, a.Hk, a.G, a.D}, q.options());
  at::Tensor lse = at::empty({a.B, a.Hk, a.G}, q.options());
  kvslim_select::write_chosen(chosen, pages);  // every check passed
  if (a.B * a.Hk * a.G > 0) run(a, splits, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

std::string quant_decode_lowbit_isa() { return kvslim_lowbit::cpu_isa(); }

// select the path ("avx2" or "scalar"; tests run both in one process); returns the previous one
std::string quant_decode_lowbit_set_isa(const std::string& isa) {
  return kvslim_lowbit::isa_switch().set("kvslim::quant_decode_lowbit_set_isa", isa);
}

#pragma GCC visibility pop

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("quant_decode_lowbit(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor v_codes, "
        "Tensor v_scale, Tensor v_zero, int k_bits, int v_bits, int group_size, int key_channel_group, int n, "
        "Tensor? lengths, Tensor? k_tail, Tensor? v_tail, Tensor? mask, float scaling, int splits=0, "
        "Tensor? pages=None, int page=0, Tensor? sel_q=None, Tensor? boxes=None, Tensor? box_scales=None, int sel_pages=0, int sel_k=0, bool sel_force=False, int sel_rest=0, Tensor(a!)? chosen=None) -> (Tensor, Tensor)");
  m.def("quant_decode_lowbit_isa() -> str", &quant_decode_lowbit_isa);
  m.def("quant_decode_lowbit_set_isa(str isa) -> str", &quant_decode_lowbit_set_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("quant_decode_lowbit", &quant_decode_lowbit_cpu); }
