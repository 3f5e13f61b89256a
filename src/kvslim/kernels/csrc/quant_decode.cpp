// kvslim::quant_decode — decode attention (one query token) straight from grouped int8 / int4 KV codes.
//
//   out[b, h, j] = Σ_t softmax_t(scaling · q[b, h, j] · k[b, h, t] + mask[b, t]) · v[b, h, t]     (B, Hk, G, D) fp32
//   lse[b, h, j] = log Σ_t exp(...)                                                                 (B, Hk, G)    fp32
//
// over tokens t = the first lengths[b] (≤ n) coded tokens, then the r rows of an optional fp32 tail (a residual
// window kept in full precision). Codes as kvslim's QuantizedStore keeps them (SPEC §1): int8 one byte per
// value; int4 two per byte, element 2i in the low nibble. Symmetric codes are signed (x = q·s), asymmetric ones
// unsigned with a zero-point (x = q·s + z; given by k_zero / v_zero). Scales / zero-points fp32, fp16 or bf16:
// per token over groups of `group_size` values, or for keys with key_channel_group = g > 0 (KIVI) per channel
// over token groups of g, group i's D parameters laid over scale rows [i·g, (i+1)·g) (D/g per row).
// The G query heads of a KV head (GQA / MQA: HF's repeat_kv order) share one pass over its codes; no
// full-precision copy of the history is made (a block of T tokens is decoded into an L1/L2 scratch at a time).
// Parallel over batch × KV heads × splits of the sequence (flash-decoding, exact log-sum-exp merge).
// int_scores: the scores from an int8-rounded query (per 32-channel block) times the codes in integer arithmetic
// (llama.cpp's q8_0 technique) where the format allows (qdot_ok in quant_decode_body.h); otherwise exact fp32.
// int_values: the value products from the softmax weights × value scales rounded to uint8 per 16-token sub-block,
// times the unsigned int4 codes in integer arithmetic (qv_ok); otherwise fp32.
// Every size and stride comes from tensor metadata and is checked here (named ValueErrors).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "decode_common.h"
#include "sparse_select_body.h"
#include "vec_quant.h"

#pragma GCC visibility push(hidden)

namespace kvslim_quant {

// a (B, H, tokens, ·) tensor with unit last stride: element (b, h, t, i) at p + b·bs + h·hs + t·ts + i
using kvslim_decode::Codes;
using kvslim_decode::Strided;

struct QArgs : kvslim_decode::Common {
  int bits = 8;
  bool asym = false;
  int64_t gs = 0, kivi = 0;
  int sdt = 0;  // parameter dtype: 0 fp32, 1 fp16, 2 bf16
  Codes k, v;
  bool qdot = false;  // scores from an int8-rounded query where the format allows (qdot_ok in the body)
  bool qvals = false;  // value products from uint8-rounded softmax weights where the format allows (qv_ok)
  const float* vunrot = nullptr;  // (D, D) M: value codes hold v·R, their weighted sum is taken back by · M = Rᵀ
  kvslim_decode::PageList paged;  // sparse decode's page list (decode_common.h; none: row t is row t)
};

inline float load_param(const Strided& s, int64_t b, int64_t h, int64_t t, int64_t i, int sdt) {
  if (sdt == 0) return s.at<float>(b, h, t)[i];
  if (sdt == 1) return static_cast<float>(s.at<c10::Half>(b, h, t)[i]);
  return static_cast<float>(s.at<c10::BFloat16>(b, h, t)[i]);
}

struct Scratch {
  int64_t T;
  std::vector<float> q, qp, qs, zq, k, sc, pw, srow, zrow, qsum, ks, kz, vs, vz;
  // integer score path: int8 query (natural order, and even / odd channels for int4), block scales and code sums,
  // signed-int4 offset corrections per head and key group
  std::vector<int8_t> q8, qe, qo;
  std::vector<float> qd, qdx, corr;
  std::vector<int32_t> qbs;
  std::vector<uint8_t> wq;  // integer value path: uint8 weights (G · groups rows of T) and their sub-block scales
  std::vector<float> wdw;
  int64_t row_group = -1;
  Scratch(const QArgs& a, int64_t T_)
      : T(T_), q(a.G * a.D), qp(a.G * a.D), qs(a.G * a.D), zq(a.G), k(T_ * a.D), sc(a.G * T_),
        pw(a.G * (a.D / a.gs) * T_), srow(a.D), zrow(a.D), qsum(a.G * (a.D / a.gs)), ks(T_ * (a.D / a.gs)),
        kz(T_ * (a.D / a.gs)), vs(T_ * (a.D / a.gs)), vz(T_ * (a.D / a.gs)), q8(a.G * a.D), qe(a.G * a.D / 2 + 1),
        qo(a.G * a.D / 2 + 1), qd(a.G * a.D / 32 + 1), qdx(a.G * a.D / 8 + 1), corr(a.G * (a.D / a.gs) + 1), qbs(a.G * a.D / 32 + 1),
        wq(a.G * (a.D / a.gs) * T_ + 16), wdw(a.G * (a.D / a.gs) * (T_ / 16) + 1) {}
};

using TaskFn = void (*)(const QArgs&, int64_t, int64_t, int64_t, int64_t, float*, float*, float*, Scratch&);

// tokens per block: ~32 KiB of decoded fp32 rows; a multiple of 16 (the integer value path's weight sub-blocks
// then start at multiples of 16 tokens of the sequence, as in the Python twin)
inline int64_t block_tokens(int64_t D) {
  return std::clamp<int64_t>(8192 / std::max<int64_t>(D, 1) / 16 * 16, 16, 256);
}

}  // namespace kvslim_quant

namespace kvslim_quant {
namespace scalar {
using V = kvslim_vec::QuantScalar;
using QD = kvslim_vec::QDotScalar;
#include "quant_decode_body.h"
}  // namespace scalar
}  // namespace kvslim_quant

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvslim_quant {
namespace avx2 {
using V = kvslim_vec::QuantAVX2;
using QD = kvslim_vec::QDotAVX2;
#include "quant_decode_body.h"
}  // namespace avx2
}  // namespace kvslim_quant
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace kvslim_quant {
namespace avx512 {
using V = kvslim_vec::QuantAVX512;
using QD = kvslim_vec::QDotAVX2;  // AVX-512 without VNNI: the AVX2 integer kernels (a subset of the target)
#include "quant_decode_body.h"
}  // namespace avx512
}  // namespace kvslim_quant
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace kvslim_quant {
namespace avx512_vnni {
using V = kvslim_vec::QuantAVX512;
using QD = kvslim_vec::QDotVNNI;  // integer scores and values with vpdpbusd
#include "quant_decode_body.h"
}  // namespace avx512_vnni
}  // namespace kvslim_quant
#pragma GCC pop_options

namespace kvslim_quant {

// instruction sets, best last; the one in force is the best the CPU has, capped by KVSLIM_ISA (read once) and by
// quant_decode_set_isa (tests run several in one process)
const char* const kIsas[] = {"scalar", "avx2", "avx512", "avx512_vnni"};

inline int cpu_best() {
  static const int best = [] {
    __builtin_cpu_init();
    int level = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) level = 1;
    if (level == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      level = 2;
    if (level == 2 && __builtin_cpu_supports("avx512vnni")) level = 3;
    return level;
  }();
  return best;
}

inline int isa_level(const std::string& name) {
  for (int i = 0; i < 4; ++i)
    if (name == kIsas[i]) return i;
  return -1;
}

inline std::atomic<int>& isa_cap() {
  static std::atomic<int> cap([] {
    const char* env = std::getenv("KVSLIM_ISA");
    const int level = env ? isa_level(env) : -1;
    return level < 0 ? 3 : level;
  }());
  return cap;
}

inline std::string cpu_isa() { return kIsas[std::min(cpu_best(), isa_cap().load())]; }

// the instruction set for head dimension D: vector paths need D a multiple of their width
inline std::string isa_for(int64_t D) {
  std::string isa = cpu_isa();
  if ((isa == "avx512" || isa == "avx512_vnni") && D % 16) isa = "avx2";
  if (isa == "avx2" && D % 8) isa = "scalar";
  return isa;
}

inline TaskFn task_fn(const std::string& isa, int bits, bool asym) {
  if (isa == "avx512_vnni") return avx512_vnni::pick(bits, asym);
  if (isa == "avx512") return avx512::pick(bits, asym);
  if (isa == "avx2") return avx2::pick(bits, asym);
  return scalar::pick(bits, asym);
}

void run(const QArgs& a, int64_t S, float* out, float* lse) {
  kvslim_decode::run_split_k<Scratch>(a, S, block_tokens(a.D), task_fn(isa_for(a.D), a.bits, a.asym), out, lse);
}

// ---- argument checks (named ValueErrors) -------------------------------------------------------------------

constexpr const char* OP = "kvslim::quant_decode";

using kvslim_decode::strided;
using kvslim_decode::unit_last;

void check_4d(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t min_tokens, int64_t width) {
  kvslim_decode::check_4d(OP, t, name, B, H, min_tokens, width);
}

}  // namespace kvslim_quant

std::tuple<at::Tensor, at::Tensor> quant_decode_cpu(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const c10::optional<at::Tensor>& k_zero,
    const at::Tensor& v_codes, const at::Tensor& v_scale, const c10::optional<at::Tensor>& v_zero, int64_t bits,
    int64_t group_size, int64_t key_channel_group, int64_t n, const c10::optional<at::Tensor>& lengths,
    const c10::optional<at::Tensor>& k_tail, const c10::optional<at::Tensor>& v_tail,
    const c10::optional<at::Tensor>& mask, double scaling, int64_t splits, bool int_scores, bool int_values,
    const c10::optional<at::Tensor>& v_unrot, const c10::optional<at::Tensor>& pages_in, int64_t page,
    const c10::optional<at::Tensor>& sel_q, const c10::optional<at::Tensor>& boxes,
    const c10::optional<at::Tensor>& box_scales, int64_t sel_pages, int64_t sel_k, bool sel_force, int64_t sel_rest,
    const c10::optional<at::Tensor>& chosen) {
  using namespace kvslim_quant;
  QArgs a;
  kvslim_decode::read_query_shape(OP, a, q);
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, OP, ": bits must be 4 or 8, got ", bits);
  a.bits = static_cast<int>(bits);
  TORCH_CHECK_VALUE(group_size > 0 && a.D % group_size == 0 && (bits == 8 || group_size % 2 == 0), OP,
                    ": group_size=", group_size, " must divide the head dimension ", a.D,
                    bits == 4 ? " and be even (int4 packs two values per byte)" : "");
  TORCH_CHECK_VALUE(bits == 8 || a.D % 2 == 0, OP, ": int4 needs an even head dimension, got ", a.D);
  a.gs = group_size;
  TORCH_CHECK_VALUE(key_channel_group >= 0 && (key_channel_group == 0 || a.D % key_channel_group == 0), OP,
                    ": key_channel_group=", key_channel_group, " must be 0 or divide the head dimension ", a.D);
  a.kivi = key_channel_group;
  TORCH_CHECK_VALUE(n >= 0, OP, ": n must be ≥ 0, got ", n);
  a.n = n;
  TORCH_CHECK_VALUE(k_zero.has_value() == v_zero.has_value(), OP, ": k_zero and v_zero come together (asymmetric)");
  a.asym = k_zero.has_value();
  const at::ScalarType code_t = (bits == 8 && !a.asym) ? at::kChar : at::kByte;
  const int64_t width = a.D * bits / 8;
  const c10::optional<at::Tensor> pages = kvslim_select::in_call(OP, pages_in, sel_q, boxes, box_scales, sel_pages,
                                                                  sel_k, sel_force, sel_rest, chosen, scaling);
  a.paged = kvslim_decode::bind_pages(OP, pages, page, a.B, a.Hk, n, a.kivi,
                                      std::min(k_codes.size(2), v_codes.size(2)));
  const int64_t rows = a.paged.pages ? 0 : n;  // rows the codes must hold (a page list: its own check above)
  check_4d(k_codes, "k_codes", a.B, a.Hk, rows, width);
  check_4d(v_codes, "v_codes", a.B, a.Hk, rows, width);
  TORCH_CHECK_VALUE(k_codes.scalar_type() == code_t && v_codes.scalar_type() == code_t, OP, ": ",
                    a.asym ? "asymmetric" : "symmetric", " int", bits, " codes must be ", code_t, ", got ",
                    k_codes.scalar_type(), " / ", v_codes.scalar_type());
  const int64_t kparams = a.kivi ? a.D / a.kivi : a.D / a.gs;
  const int64_t ktokens = a.paged.pages ? k_codes.size(2) / page * page
                                   : a.kivi ? (n + a.kivi - 1) / a.kivi * a.kivi : n;
  check_4d(k_scale, "k_scale", a.B, a.Hk, ktokens, kparams);
  check_4d(v_scale, "v_scale", a.B, a.Hk, a.paged.pages ? ktokens : n, a.D / a.gs);
  a.sdt = kvslim_decode::param_code(OP, k_scale.scalar_type());
  TORCH_CHECK_VALUE(v_scale.scalar_type() == k_scale.scalar_type(), OP, ": k_scale and v_scale dtypes differ");
  at::Tensor kc = unit_last(k_codes), vc = unit_last(v_codes), ks = unit_last(k_scale), vs = unit_last(v_scale);
  at::Tensor kz, vz;
  if (a.asym) {
    check_4d(*k_zero, "k_zero", a.B, a.Hk, ktokens, kparams);
    check_4d(*v_zero, "v_zero", a.B, a.Hk, a.paged.pages ? ktokens : n, a.D / a.gs);
    TORCH_CHECK_VALUE(k_zero->scalar_type() == k_scale.scalar_type() && v_zero->scalar_type() == k_scale.scalar_type(),
                      OP, ": zero-points must have the scales' dtype ", k_scale.scalar_type());
    kz = unit_last(*k_zero);
    vz = unit_last(*v_zero);
    a.k.zero = strided(kz);
    a.v.zero = strided(vz);
  }
  a.k.codes = strided(kc);
  a.v.codes = strided(vc);
  a.k.scale = strided(ks);
  a.v.scale = strided(vs);
  const kvslim_decode::Held held = kvslim_decode::bind_common(OP, a, q, scaling, lengths, k_tail, v_tail, mask);
  a.qdot = int_scores;
  a.qvals = int_values;
  at::Tensor unrot;
  if (v_unrot.has_value()) {
    const at::Tensor& m = *v_unrot;
    TORCH_CHECK_VALUE(m.device().is_cpu() && m.scalar_type() == at::kFloat && m.dim() == 2 && m.size(0) == a.D &&
                          m.size(1) == a.D,
                      OP, ": v_unrot must be a float32 CPU tensor of shape (", a.D, ", ", a.D, ") (Rᵀ of the value ",
                      "codes' rotation), got ", m.scalar_type(), " ", m.sizes(), " on ", m.device());
    unrot = m.contiguous();
    a.vunrot = unrot.data_ptr<float>();
  }
  at::Tensor out = at::empty({a.B, a.Hk, a.G, a.D}, q.options());
  at::Tensor lse = at::empty({a.B, a.Hk, a.G}, q.options());
  kvslim_select::write_chosen(chosen, pages);  // every check passed
  if (a.B * a.Hk * a.G > 0) run(a, splits, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

std::string quant_decode_isa(int64_t head_dim) { return kvslim_quant::isa_for(head_dim); }

// cap the instruction set ("scalar", "avx2", "avx512", "avx512_vnni"; the CPU's best is used when it is lower);
// returns the previous cap. Tests compare the paths in one process.
std::string quant_decode_set_isa(const std::string& isa) {
  using namespace kvslim_quant;
  const int level = isa_level(isa);
  TORCH_CHECK_VALUE(level >= 0, "kvslim::quant_decode_set_isa: isa must be one of 'scalar', 'avx2', 'avx512', "
                    "'avx512_vnni', got '", isa, "'");
  return kIsas[isa_cap().exchange(level)];
}

#pragma GCC visibility pop

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("quant_decode(Tensor q, Tensor k_codes, Tensor k_scale, Tensor? k_zero, Tensor v_codes, Tensor v_scale, "
        "Tensor? v_zero, int bits, int group_size, int key_channel_group, int n, Tensor? lengths, Tensor? k_tail, "
        "Tensor? v_tail, Tensor? mask, float scaling, int splits=0, bool int_scores=False, bool int_values=False, "
        "Tensor? v_unrot=None, Tensor? pages=None, int page=0, Tensor? sel_q=None, Tensor? boxes=None, Tensor? box_scales=None, int sel_pages=0, int sel_k=0, bool sel_force=False, int sel_rest=0, Tensor(a!)? chosen=None) -> (Tensor, Tensor)");
  m.def("quant_decode_isa(int head_dim) -> str", &quant_decode_isa);
  m.def("quant_decode_set_isa(str isa) -> str", &quant_decode_set_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("quant_decode", &quant_decode_cpu); }
