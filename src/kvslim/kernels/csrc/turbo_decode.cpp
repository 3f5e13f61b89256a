// kvslim::turbo_decode — decode attention (one query token) straight from TurboQuant-class codes (turbo2/3/4,
// kvslim/ops/turbo.py, caches/turbo.py).
//
//   out[b, h, j] = Σ_t softmax_t(scaling · q[b, h, j] · k_t + mask[b, t]) · v_t        (B, Hk, G, D) fp32
//   lse[b, h, j] = log Σ_t exp(scaling · q[b, h, j] · k_t + mask[b, t])            (B, Hk, G)    fp32
//
// over the first n coded tokens, then the r rows of an optional fp32 tail. Everything is in the stores' coded
// bases: the caller rotates (and permutes) the query and the tail into them and rotates the output back once.
// A coded key row: channels [0, k_out) at k_bits + 1 bits, the rest at k_bits, each part with its own scale
// (k_scale (B, Hk, T, parts)); k_t[i] = scale[part(i)] · levels[bits(i)][code_i]. A value row: v_bits bits, one
// scale. Codes: little-endian bit streams per row (kvslim's packing: code i at bits [b·i, b·i + b) of the row; the
// outlier part first, the rest from byte k_out·(k_bits + 1)/8). levels: (5, 16) fp32, row b the 2^b levels of the
// b-bit codebook. Scales fp32, fp16 or bf16. Each coded row is decoded once into a D-float buffer (level ×
// its part's scale), then G dot products (keys) or G axpys (values).
// Parallel over batch × KV heads. Every size comes from tensor metadata and is checked (named ValueErrors).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#pragma GCC visibility push(hidden)

namespace kvslim_turbo {

constexpr const char* kOp = "turbo_decode";

inline void check4(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t min_t, int64_t w) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), kOp, ": ", name, " must be on CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(2) >= min_t && t.size(3) == w, kOp,
                    ": ", name, " must be (B=", B, ", Hk=", H, ", >=", min_t, " tokens, ", w, "), got ", t.sizes());
}

// count codes of `bits` bits from the little-endian bit stream at p (count fills whole bytes), as their levels
// times `scale`: 8 codes per 3 bytes at 3 bits, 4 / 2 codes per byte at 2 / 4 bits
inline void decode_part(const uint8_t* p, int bits, int64_t count, const float* lev, float scale, float* out) {
  float l[16];
  for (int c = 0; c < (1 << bits); ++c) l[c] = lev[c] * scale;
  if (bits == 3) {
    for (int64_t i = 0; i < count; i += 8, p += 3) {
      const uint32_t w = p[0] | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16);
      for (int j = 0; j < 8; ++j) out[i + j] = l[(w >> (3 * j)) & 7u];
    }
    return;
  }
  const int per = 8 / bits;
  const uint32_t m = (1u << bits) - 1;
  for (int64_t i = 0; i < count; i += per, ++p)
    for (int j = 0; j < per; ++j) out[i + j] = l[(p[0] >> (bits * j)) & m];
}

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

template <class S>
void run(const float* q, const uint8_t* kc, const S* ks, const uint8_t* vc, const S* vs, const float* lev,
         int64_t B, int64_t Hk, int64_t G, int64_t D, int64_t n, int64_t k_out, int kb, int vb,
         at::IntArrayRef kcs, at::IntArrayRef kss, at::IntArrayRef vcs, at::IntArrayRef vss, int64_t kbytes,
         int64_t vbytes, int64_t kparts, const float* kt, const float* vt, at::IntArrayRef kts,
         at::IntArrayRef vts, int64_t r, const float* mask, int64_t mask_bs, float scaling, float* out,
         float* lse) {
  (void)kbytes;
  (void)vbytes;
  const int64_t out_bytes = k_out * (kb + 1) / 8;
  at::parallel_for(0, B * Hk, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(G * (n + r)), acc(G * D), row_f(D);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / Hk, h = bh % Hk;
      const float* qb = q + bh * G * D;
      const float* mrow = mask ? mask + b * mask_bs : nullptr;
      for (int64_t t = 0; t < n; ++t) {  // each key row decoded once (levels × its part's scale), then G dots
        const uint8_t* row = kc + b * kcs[0] + h * kcs[1] + t * kcs[2];
        const S* sc = ks + b * kss[0] + h * kss[1] + t * kss[2];
        if (k_out) decode_part(row, kb + 1, k_out, lev + (kb + 1) * 16, static_cast<float>(sc[0]), row_f.data());
        decode_part(row + out_bytes, kb, D - k_out, lev + kb * 16, static_cast<float>(sc[kparts - 1]),
                    row_f.data() + k_out);
        for (int64_t g = 0; g < G; ++g)
          scores[g * (n + r) + t] = scaling * dot(qb + g * D, row_f.data(), D) + (mrow ? mrow[t] : 0.f);
      }
      for (int64_t t = 0; t < r; ++t) {
        const float* kr = kt + b * kts[0] + h * kts[1] + t * kts[2];
        for (int64_t g = 0; g < G; ++g) {
          float a = 0.f;
          for (int64_t i = 0; i < D; ++i) a += qb[g * D + i] * kr[i];
          scores[g * (n + r) + n + t] = scaling * a + (mrow ? mrow[n + t] : 0.f);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> den(G), mx(G);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * (n + r);
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n + r; ++t) m = std::max(m, s[t]);
        float d = 0.f;
        for (int64_t t = 0; t < n + r; ++t) {
          s[t] = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s[t] - m);
          d += s[t];
        }
        den[g] = d;
        mx[g] = m;
      }
      for (int64_t t = 0; t < n; ++t) {  // each value row decoded once, then G axpys
        const uint8_t* row = vc + b * vcs[0] + h * vcs[1] + t * vcs[2];
        decode_part(row, vb, D, lev + vb * 16, static_cast<float>(vs[b * vss[0] + h * vss[1] + t * vss[2]]),
                    row_f.data());
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * (n + r) + t];
          float* o = acc.data() + g * D;
          const float* vr = row_f.data();
          for (int64_t i = 0; i < D; ++i) o[i] += w * vr[i];
        }
      }
      for (int64_t t = 0; t < r; ++t) {
        const float* vr = vt + b * vts[0] + h * vts[1] + t * vts[2];
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * (n + r) + n + t];
          float* o = acc.data() + g * D;
          for (int64_t i = 0; i < D; ++i) o[i] += w * vr[i];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float d = den[g];
        for (int64_t i = 0; i < D; ++i) out[(bh * G + g) * D + i] = d > 0.f ? acc[g * D + i] / d : 0.f;
        lse[bh * G + g] = d > 0.f ? mx[g] + std::log(d) : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> turbo_decode(const at::Tensor& q_in, const at::Tensor& k_codes,
                                                const at::Tensor& k_scale, const at::Tensor& v_codes,
                                                const at::Tensor& v_scale, int64_t k_out, int64_t k_bits,
                                                int64_t v_bits, const at::Tensor& levels_in, int64_t n,
                                                const c10::optional<at::Tensor>& k_tail,
                                                const c10::optional<at::Tensor>& v_tail,
                                                const c10::optional<at::Tensor>& mask_in, double scaling) {
  TORCH_CHECK_VALUE(q_in.dim() == 4 && q_in.device().is_cpu(), kOp, ": q must be a (B, Hk, G, D) CPU tensor, got ",
                    q_in.sizes(), " on ", q_in.device());
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const int64_t B = q.size(0), Hk = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(k_bits >= 2 && k_bits <= 4 && v_bits >= 2 && v_bits <= 4, kOp,
                    ": k_bits and v_bits must be 2, 3 or 4, got ", k_bits, ", ", v_bits);
  TORCH_CHECK_VALUE(k_out >= 0 && k_out < D && (k_out == 0 || k_bits < 4), kOp,
                    ": k_out must be in [0, D) and 0 with 4-bit keys, got ", k_out);
  TORCH_CHECK_VALUE((k_out * (k_bits + 1)) % 8 == 0 && ((D - k_out) * k_bits) % 8 == 0 && (D * v_bits) % 8 == 0,
                    kOp, ": parts must fill whole bytes (k_out=", k_out, ", D=", D, ")");
  TORCH_CHECK_VALUE(n >= 0, kOp, ": n must be >= 0, got ", n);
  const int64_t kbytes = (k_out * (k_bits + 1) + (D - k_out) * k_bits) / 8, vbytes = D * v_bits / 8;
  const int64_t kparts = k_out ? 2 : 1;
  TORCH_CHECK_VALUE(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte, kOp,
                    ": codes must be uint8");
  check4(k_codes, "k_codes", B, Hk, n, kbytes);
  check4(v_codes, "v_codes", B, Hk, n, vbytes);
  check4(k_scale, "k_scale", B, Hk, n, kparts);
  check4(v_scale, "v_scale", B, Hk, n, 1);
  TORCH_CHECK_VALUE(k_scale.scalar_type() == v_scale.scalar_type(), kOp, ": k_scale and v_scale must share a dtype");
  const at::Tensor levels = levels_in.to(at::kFloat).contiguous();
  TORCH_CHECK_VALUE(levels.dim() == 2 && levels.size(0) == 5 && levels.size(1) == 16, kOp,
                    ": levels must be (5, 16), got ", levels.sizes());
  at::Tensor kt, vt;
  int64_t r = 0;
  if (k_tail.has_value() && k_tail->defined()) {
    TORCH_CHECK_VALUE(v_tail.has_value() && v_tail->defined(), kOp, ": k_tail needs v_tail");
    r = k_tail->size(2);
    kt = k_tail->to(at::kFloat);
    vt = v_tail->to(at::kFloat);
    if (kt.stride(3) != 1) kt = kt.contiguous();
    if (vt.stride(3) != 1) vt = vt.contiguous();
    check4(kt, "k_tail", B, Hk, r, D);
    check4(vt, "v_tail", B, Hk, r, D);
    TORCH_CHECK_VALUE(vt.size(2) == r, kOp, ": k_tail and v_tail must hold the same rows");
  }
  at::Tensor mask;
  int64_t mask_bs = 0;
  if (mask_in.has_value() && mask_in->defined()) {
    mask = mask_in->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(mask.dim() == 2 && (mask.size(0) == 1 || mask.size(0) == B) && mask.size(1) == n + r, kOp,
                      ": mask must be (B|1, n + r = ", n + r, "), got ", mask.sizes());
    mask_bs = mask.size(0) == 1 ? 0 : mask.size(1);
  }
  at::Tensor out = at::empty({B, Hk, G, D}, q.options()), lse = at::empty({B, Hk, G}, q.options());
  const at::Tensor kc = k_codes.stride(3) == 1 ? k_codes : k_codes.contiguous();
  const at::Tensor vc = v_codes.stride(3) == 1 ? v_codes : v_codes.contiguous();
  const at::Tensor ks = k_scale.stride(3) == 1 ? k_scale : k_scale.contiguous();
  const at::Tensor vs = v_scale.stride(3) == 1 ? v_scale : v_scale.contiguous();
  const float* ktp = r ? kt.data_ptr<float>() : nullptr;
  const float* vtp = r ? vt.data_ptr<float>() : nullptr;
  std::vector<int64_t> zero4(4, 0);
  at::IntArrayRef kts = r ? kt.strides() : at::IntArrayRef(zero4), vts = r ? vt.strides() : at::IntArrayRef(zero4);
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  auto go = [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    run<S>(q.data_ptr<float>(), kc.data_ptr<uint8_t>(), ks.data_ptr<S>(), vc.data_ptr<uint8_t>(), vs.data_ptr<S>(),
           levels.data_ptr<float>(), B, Hk, G, D, n, k_out, static_cast<int>(k_bits), static_cast<int>(v_bits),
           kc.strides(), ks.strides(), vc.strides(), vs.strides(), kbytes, vbytes, kparts, ktp, vtp, kts, vts, r, mp,
           mask_bs, static_cast<float>(scaling), out.data_ptr<float>(), lse.data_ptr<float>());
  };
  switch (k_scale.scalar_type()) {
    case at::kFloat: go(static_cast<float*>(nullptr)); break;
    case at::kHalf: go(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: go(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK_VALUE(false, kOp, ": scales must be float32, float16 or bfloat16, got ", k_scale.scalar_type());
  }
  return {out, lse};
}

}  // namespace kvslim_turbo

#pragma GCC visibility pop

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("turbo_decode(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v_codes, Tensor v_scale, int k_out, "
        "int k_bits, int v_bits, Tensor levels, int n, Tensor? k_tail, Tensor? v_tail, Tensor? mask, "
        "float scaling) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("turbo_decode", &kvslim_turbo::turbo_decode); }
