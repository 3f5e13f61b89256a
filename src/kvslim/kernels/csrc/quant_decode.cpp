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
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "vec_quant.h"

#pragma GCC visibility push(hidden)

namespace kvslim_quant {

// a (B, H, tokens, ·) tensor with unit last stride: element (b, h, t, i) at p + b·bs + h·hs + t·ts + i
struct Strided {
  const void* p = nullptr;
  int64_t bs = 0, hs = 0, ts = 0;
  template <class T>
  const T* at(int64_t b, int64_t h, int64_t t) const {
    return static_cast<const T*>(p) + b * bs + h * hs + t * ts;
  }
};

struct Codes {
  Strided codes, scale, zero;
};

struct QArgs {
  int64_t B = 0, Hk = 0, G = 0, D = 0;
  const float* q = nullptr;  // (B, Hk, G, D) contiguous
  float scaling = 1.f;
  int bits = 8;
  bool asym = false;
  int64_t gs = 0, kivi = 0;
  int sdt = 0;  // parameter dtype: 0 fp32, 1 fp16, 2 bf16
  Codes k, v;
  int64_t n = 0;
  const int64_t* lengths = nullptr;
  Strided kt, vt;  // fp32 tail (B, Hk, r, D)
  int64_t r = 0;
  const float* mask = nullptr;  // (B|1, n + r) additive
  int64_t mask_bs = 0;
  bool qdot = false;  // scores from an int8-rounded query where the format allows (qdot_ok in the body)
  bool qvals = false;  // value products from uint8-rounded softmax weights where the format allows (qv_ok)
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
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace kvslim_quant {
namespace avx512 {
using V = kvslim_vec::QuantAVX512;
using QD = kvslim_vec::QDotAVX2;  // no AVX-512 integer kernels: the AVX2 ones (a subset of the target)
#include "quant_decode_body.h"
}  // namespace avx512
}  // namespace kvslim_quant
#pragma GCC pop_options

namespace kvslim_quant {

// the best instruction set of the CPU (KVSLIM_ISA=scalar|avx2|avx512 caps it, for tests)
inline std::string cpu_isa() {
  static const std::string name = [] {
    __builtin_cpu_init();
    const char* cap = std::getenv("KVSLIM_ISA");
    const std::string want = cap ? cap : "avx512";
    if (want == "avx512" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return std::string("avx512");
    if (want != "scalar" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return std::string("avx2");
    return std::string("scalar");
  }();
  return name;
}

// the instruction set for head dimension D: vector paths need D a multiple of their width
inline std::string isa_for(int64_t D) {
  std::string isa = cpu_isa();
  if (isa == "avx512" && D % 16) isa = "avx2";
  if (isa == "avx2" && D % 8) isa = "scalar";
  return isa;
}

inline TaskFn task_fn(const std::string& isa, int bits, bool asym) {
  if (isa == "avx512") return avx512::pick(bits, asym);
  if (isa == "avx2") return avx2::pick(bits, asym);
  return scalar::pick(bits, asym);
}

inline int64_t auto_splits(int64_t tasks, int64_t n, int64_t T) {
  const int64_t threads = at::get_num_threads();
  if (tasks >= threads && tasks % threads == 0) return 1;
  if (tasks >= 4 * threads) return 1;
  const int64_t want = (4 * threads + tasks - 1) / tasks;
  return std::max<int64_t>(1, std::min<int64_t>(want, (n + 2 * T - 1) / (2 * T)));
}

// normalise one (sequence, KV head)'s G rows in place and write their lse (one split: no merge needed)
inline void finish_rows(float* o, const float* m, const float* l, float* lse, int64_t G, int64_t D) {
  for (int64_t j = 0; j < G; ++j) {
    const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
    for (int64_t i = 0; i < D; ++i) o[j * D + i] *= inv;
    lse[j] = l[j] > 0.f ? m[j] + std::log(l[j]) : -INFINITY;
  }
}

void run(const QArgs& a, int64_t S, float* out, float* lse) {
  const int64_t T = block_tokens(a.D);
  const int64_t BH = a.B * a.Hk, GD = a.G * a.D;
  if (S <= 0) S = auto_splits(BH, a.n, T);
  S = std::max<int64_t>(1, std::min<int64_t>(S, (a.n + T - 1) / T));
  const TaskFn fn = task_fn(isa_for(a.D), a.bits, a.asym);
  std::vector<float> part_acc, part_m(BH * S * a.G), part_l(BH * S * a.G);
  if (S > 1) part_acc.resize(BH * S * GD);
  // one task per (sequence, KV head, split); a grain that keeps small problems (1k x 1) on few threads
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(BH * S, 4096 / std::max<int64_t>(a.n, 1)));
  at::parallel_for(0, BH * S, grain, [&](int64_t begin, int64_t end) {
    Scratch sp(a, T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / S, s = task % S;
      float* acc = S > 1 ? part_acc.data() + task * GD : out + bh * GD;
      float* m = part_m.data() + task * a.G;
      float* l = part_l.data() + task * a.G;
      fn(a, bh / a.Hk, bh % a.Hk, s, S, acc, m, l, sp);
      if (S == 1) finish_rows(acc, m, l, lse + bh * a.G, a.G, a.D);
    }
  });
  if (S == 1) return;
  // merge the splits exactly: weights exp(m_s − M), denominator Σ l_s exp(m_s − M)
  at::parallel_for(0, BH * a.G, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(S);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / a.G, j = row % a.G;
      float M = -INFINITY;
      for (int64_t s = 0; s < S; ++s) M = std::max(M, part_m[(bh * S + s) * a.G + j]);
      float den = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const float ms = part_m[(bh * S + s) * a.G + j];
        w[s] = ms == -INFINITY ? 0.f : std::exp(ms - M);
        den += w[s] * part_l[(bh * S + s) * a.G + j];
      }
      float* o = out + row * a.D;
      const float inv = den > 0.f ? 1.f / den : 0.f;
      std::fill(o, o + a.D, 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const float f = w[s] * inv;
        if (f == 0.f) continue;
        const float* p = part_acc.data() + (bh * S + s) * GD + j * a.D;
        for (int64_t i = 0; i < a.D; ++i) o[i] += f * p[i];
      }
      lse[row] = den > 0.f ? M + std::log(den) : -INFINITY;
    }
  });
}

// ---- argument checks (named ValueErrors) -------------------------------------------------------------------

constexpr const char* OP = "kvslim::quant_decode";

Strided strided(const at::Tensor& t) { return Strided{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

at::Tensor unit_last(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

void check_4d(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t min_tokens, int64_t width) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), OP, ": ", name, " must be on CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(2) >= min_tokens && t.size(3) == width,
                    OP, ": ", name, " must be (B=", B, ", Hk=", H, ", ≥", min_tokens, " tokens, ", width, "), got ",
                    t.sizes());
}

int param_code(at::ScalarType t) {
  if (t == at::kFloat) return 0;
  if (t == at::kHalf) return 1;
  TORCH_CHECK_VALUE(t == at::kBFloat16, OP, ": scales must be float32, float16 or bfloat16, got ", t);
  return 2;
}

}  // namespace kvslim_quant

std::tuple<at::Tensor, at::Tensor> quant_decode_cpu(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const c10::optional<at::Tensor>& k_zero,
    const at::Tensor& v_codes, const at::Tensor& v_scale, const c10::optional<at::Tensor>& v_zero, int64_t bits,
    int64_t group_size, int64_t key_channel_group, int64_t n, const c10::optional<at::Tensor>& lengths,
    const c10::optional<at::Tensor>& k_tail, const c10::optional<at::Tensor>& v_tail,
    const c10::optional<at::Tensor>& mask, double scaling, int64_t splits, bool int_scores, bool int_values) {
  using namespace kvslim_quant;
  QArgs a;
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 4 && q.size(2) >= 1 &&
                        q.size(3) >= 1,
                    OP, ": q must be float32 (B, Hk, G, D) on CPU, got ", q.scalar_type(), " ", q.sizes());
  a.B = q.size(0);
  a.Hk = q.size(1);
  a.G = q.size(2);
  a.D = q.size(3);
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
  check_4d(k_codes, "k_codes", a.B, a.Hk, n, width);
  check_4d(v_codes, "v_codes", a.B, a.Hk, n, width);
  TORCH_CHECK_VALUE(k_codes.scalar_type() == code_t && v_codes.scalar_type() == code_t, OP, ": ",
                    a.asym ? "asymmetric" : "symmetric", " int", bits, " codes must be ", code_t, ", got ",
                    k_codes.scalar_type(), " / ", v_codes.scalar_type());
  const int64_t kparams = a.kivi ? a.D / a.kivi : a.D / a.gs;
  const int64_t ktokens = a.kivi ? (n + a.kivi - 1) / a.kivi * a.kivi : n;
  check_4d(k_scale, "k_scale", a.B, a.Hk, ktokens, kparams);
  check_4d(v_scale, "v_scale", a.B, a.Hk, n, a.D / a.gs);
  a.sdt = param_code(k_scale.scalar_type());
  TORCH_CHECK_VALUE(v_scale.scalar_type() == k_scale.scalar_type(), OP, ": k_scale and v_scale dtypes differ");
  at::Tensor kc = unit_last(k_codes), vc = unit_last(v_codes), ks = unit_last(k_scale), vs = unit_last(v_scale);
  at::Tensor kz, vz;
  if (a.asym) {
    check_4d(*k_zero, "k_zero", a.B, a.Hk, ktokens, kparams);
    check_4d(*v_zero, "v_zero", a.B, a.Hk, n, a.D / a.gs);
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
  at::Tensor lk, kt, vt, mk;
  if (lengths.has_value()) {
    const auto& l = *lengths;
    TORCH_CHECK_VALUE(l.device().is_cpu() && l.scalar_type() == at::kLong && l.dim() == 1 && l.size(0) == a.B, OP,
                      ": lengths must be an int64 CPU tensor of shape (B=", a.B, ",), got ", l.scalar_type(), " ",
                      l.sizes());
    lk = l.contiguous();
    const int64_t* p = lk.data_ptr<int64_t>();
    for (int64_t b = 0; b < a.B; ++b)
      TORCH_CHECK_VALUE(p[b] >= 0 && p[b] <= n, OP, ": lengths[", b, "] = ", p[b], " is outside [0, n=", n, "]");
    a.lengths = p;
  }
  TORCH_CHECK_VALUE(k_tail.has_value() == v_tail.has_value(), OP, ": k_tail and v_tail come together");
  if (k_tail.has_value()) {
    TORCH_CHECK_VALUE(k_tail->scalar_type() == at::kFloat && v_tail->scalar_type() == at::kFloat, OP,
                      ": k_tail / v_tail must be float32");
    check_4d(*k_tail, "k_tail", a.B, a.Hk, 0, a.D);
    check_4d(*v_tail, "v_tail", a.B, a.Hk, k_tail->size(2), a.D);
    TORCH_CHECK_VALUE(v_tail->size(2) == k_tail->size(2), OP, ": k_tail and v_tail hold different token counts");
    kt = unit_last(*k_tail);
    vt = unit_last(*v_tail);
    a.r = kt.size(2);
    a.kt = strided(kt);
    a.vt = strided(vt);
  }
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK_VALUE(m.device().is_cpu() && m.scalar_type() == at::kFloat && m.dim() == 2 &&
                          (m.size(0) == 1 || m.size(0) == a.B) && m.size(1) == n + a.r,
                      OP, ": mask must be float32 (1 or B=", a.B, ", n + tail=", n + a.r, "), got ", m.scalar_type(),
                      " ", m.sizes());
    mk = m.stride(1) == 1 ? m : m.contiguous();
    a.mask = mk.data_ptr<float>();
    a.mask_bs = mk.size(0) == 1 ? 0 : mk.stride(0);
  }
  at::Tensor qc = q.contiguous();
  a.q = qc.data_ptr<float>();
  a.scaling = static_cast<float>(scaling);
  a.qdot = int_scores;
  a.qvals = int_values;
  at::Tensor out = at::empty({a.B, a.Hk, a.G, a.D}, q.options());
  at::Tensor lse = at::empty({a.B, a.Hk, a.G}, q.options());
  if (a.B * a.Hk * a.G > 0) run(a, splits, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

std::string quant_decode_isa(int64_t head_dim) { return kvslim_quant::isa_for(head_dim); }

#pragma GCC visibility pop

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("quant_decode(Tensor q, Tensor k_codes, Tensor k_scale, Tensor? k_zero, Tensor v_codes, Tensor v_scale, "
        "Tensor? v_zero, int bits, int group_size, int key_channel_group, int n, Tensor? lengths, Tensor? k_tail, "
        "Tensor? v_tail, Tensor? mask, float scaling, int splits=0, bool int_scores=False, bool int_values=False) -> (Tensor, Tensor)");
  m.def("quant_decode_isa(int head_dim) -> str", &quant_decode_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("quant_decode", &quant_decode_cpu); }
