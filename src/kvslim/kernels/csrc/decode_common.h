// What the quantized decode ops (quant_decode.cpp, quant_decode_lowbit.cpp) share, independent of the instruction
// set: strided views of (B, H, tokens, ·) tensors, the common inputs (query, lengths, fp32 tail, additive mask) and
// their checks (named ValueErrors, every size from tensor metadata), a task's start (start_task, group_sums), the
// AVX2-or-scalar switch of the 2/3-bit and turbo ops (Avx2OrScalar), and the split-K driver: one task per
// (sequence, KV head, split), then an exact log-sum-exp merge of the splits. The per-instruction-set half is
// decode_task_body.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace kvslim_decode {

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

// Software prefetch of the code rows a loop reaches kPrefetchRows tokens from now (1-4 KB ahead: about a DRAM round
// trip at the loops' pace). The hardware prefetchers stop at each 4 KB page, which a block of 128 int4 rows of
// head dim 64 exactly fills, so without this every block's rows start with misses (measured: the int4 op 1.13× /
// 1.15× faster with the key / value rows prefetched). A prefetch past the stored rows reads nothing. A task walking a
// page list (sparse decode) fetches its next listed page whole while it computes one (the ops' run_task): a listed
// page sits anywhere in memory, where neither this distance nor the hardware prefetchers reach it (one int4 layer at
// 32k, budget 2,048, cold: a sparse call 1.5-1.8× faster; int2 and turbo3 alike).
constexpr int64_t kPrefetchRows = 64;
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// Sparse decode: a task walking a page list (struct PageList below) at its block of logical rows [t0, t0 + m) fetches
// the next listed page's stored rows of the N tensors PF[i] (values of EL[i] bytes) while it computes this one: a
// listed page sits anywhere in memory, where the loops' fixed-distance prefetch and the hardware prefetchers never
// reach it (one int4 layer at 32k × 8, cold: 4.4 → 2.8 ms). Nothing without a list or at the task's last block. A
// macro, not a function: the same code as an inline function (or a template on the op's args) measured no gain. The
// reason, found later (sparse_select_body.h's prefetch_box): GCC keeps a function whose only effect is a prefetch
// out of line and treats it as pure, so it deletes the calls (objdump: no prefetch instruction left in the .so);
// such a helper must be always_inline.
#define KVSLIM_PREFETCH_NEXT_PAGE(a, b, h, t0, m, t_end, PF, EL, N)                                                  \
  if ((a).paged.pages && (t0) + (m) < (t_end)) {                                                                    \
    const int64_t tn_ = (t0) + (m), mn_ = std::min((a).paged.page - tn_ % (a).paged.page, (t_end) - tn_);         \
    const int64_t rn_ =                                                                                              \
        (a).paged.pages[((b) * (a).Hk + (h)) * (a).paged.npages + tn_ / (a).paged.page] * (a).paged.page +          \
        tn_ % (a).paged.page;                                                                                        \
    for (int i_ = 0; i_ < (N); ++i_)                                                                                 \
      if ((PF)[i_]->p)                                                                                               \
        kvslim_decode::prefetch_span(static_cast<const char*>((PF)[i_]->p) +                                          \
                                         ((b) * (PF)[i_]->bs + (h) * (PF)[i_]->hs + rn_ * (PF)[i_]->ts) * (EL)[i_],   \
                                     mn_ * (PF)[i_]->ts * (EL)[i_]);                                                  \
  }

// the inputs every decode op has besides its codes; an op's argument struct derives from it
struct Common {
  int64_t B = 0, Hk = 0, G = 0, D = 0;
  const float* q = nullptr;  // (B, Hk, G, D) contiguous
  float scaling = 1.f;
  int64_t n = 0;  // coded tokens
  const int64_t* lengths = nullptr;
  Strided kt, vt;  // fp32 tail (B, Hk, r, D)
  int64_t r = 0;
  const float* mask = nullptr;  // (B|1, n + r) additive
  int64_t mask_bs = 0;
};

// the tensors the pointers in Common refer to (contiguous copies where needed): keep alive while the op runs
struct Held {
  at::Tensor q, lengths, k_tail, v_tail, mask;
};

inline Strided strided(const at::Tensor& t) { return Strided{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

inline at::Tensor unit_last(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

inline void check_4d(const char* op, const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t min_tokens,
                     int64_t width) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(2) >= min_tokens && t.size(3) == width,
                    op, ": ", name, " must be (B=", B, ", Hk=", H, ", ≥", min_tokens, " tokens, ", width, "), got ",
                    t.sizes());
}

// parameter dtype code: 0 fp32, 1 fp16, 2 bf16
inline int param_code(const char* op, at::ScalarType t) {
  if (t == at::kFloat) return 0;
  if (t == at::kHalf) return 1;
  TORCH_CHECK_VALUE(t == at::kBFloat16, op, ": scales must be float32, float16 or bfloat16, got ", t);
  return 2;
}

// the query's shape into a (B, Hk, G, D), checked
inline void read_query_shape(const char* op, Common& a, const at::Tensor& q) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 4 && q.size(2) >= 1 &&
                        q.size(3) >= 1,
                    op, ": q must be float32 (B, Hk, G, D) on CPU, got ", q.scalar_type(), " ", q.sizes());
  a.B = q.size(0);
  a.Hk = q.size(1);
  a.G = q.size(2);
  a.D = q.size(3);
}

// query data, scaling, lengths, tail and mask into a (a.B, a.Hk, a.D and a.n already set), checked
inline Held bind_common(const char* op, Common& a, const at::Tensor& q, double scaling,
                        const c10::optional<at::Tensor>& lengths, const c10::optional<at::Tensor>& k_tail,
                        const c10::optional<at::Tensor>& v_tail, const c10::optional<at::Tensor>& mask) {
  Held held;
  const int64_t n = a.n;
  if (lengths.has_value()) {
    const auto& l = *lengths;
    TORCH_CHECK_VALUE(l.device().is_cpu() && l.scalar_type() == at::kLong && l.dim() == 1 && l.size(0) == a.B, op,
                      ": lengths must be an int64 CPU tensor of shape (B=", a.B, ",), got ", l.scalar_type(), " ",
                      l.sizes());
    held.lengths = l.contiguous();
    const int64_t* p = held.lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < a.B; ++b)
      TORCH_CHECK_VALUE(p[b] >= 0 && p[b] <= n, op, ": lengths[", b, "] = ", p[b], " is outside [0, n=", n, "]");
    a.lengths = p;
  }
  TORCH_CHECK_VALUE(k_tail.has_value() == v_tail.has_value(), op, ": k_tail and v_tail come together");
  if (k_tail.has_value()) {
    TORCH_CHECK_VALUE(k_tail->scalar_type() == at::kFloat && v_tail->scalar_type() == at::kFloat, op,
                      ": k_tail / v_tail must be float32");
    check_4d(op, *k_tail, "k_tail", a.B, a.Hk, 0, a.D);
    check_4d(op, *v_tail, "v_tail", a.B, a.Hk, k_tail->size(2), a.D);
    TORCH_CHECK_VALUE(v_tail->size(2) == k_tail->size(2), op, ": k_tail and v_tail hold different token counts");
    held.k_tail = unit_last(*k_tail);
    held.v_tail = unit_last(*v_tail);
    a.r = held.k_tail.size(2);
    a.kt = strided(held.k_tail);
    a.vt = strided(held.v_tail);
  }
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK_VALUE(m.device().is_cpu() && m.scalar_type() == at::kFloat && m.dim() == 2 &&
                          (m.size(0) == 1 || m.size(0) == a.B) && m.size(1) == n + a.r,
                      op, ": mask must be float32 (1 or B=", a.B, ", n + tail=", n + a.r, "), got ", m.scalar_type(),
                      " ", m.sizes());
    held.mask = m.stride(1) == 1 ? m : m.contiguous();
    a.mask = held.mask.data_ptr<float>();
    a.mask_bs = held.mask.size(0) == 1 ? 0 : held.mask.stride(0);
  }
  held.q = q.contiguous();
  a.q = held.q.data_ptr<float>();
  a.scaling = static_cast<float>(scaling);
  return held;
}

// One task's start: its token range (split s of S over the first len coded tokens, in whole blocks of T), the
// (sequence b, KV head h)'s query times scaling into q (G × D), acc (G × D) / m / l (G) cleared. Returns the
// sequence's mask row (nullptr: no mask).
// Sparse decode's page list (docs/sparse.md): the n coded rows of a call are logical, row t of (b, h) stored at row
// pages[b, h, t / page]·page + t % page. A task walks its rows in blocks; `paged_block` clips a block at its page and
// gives the stored row of its first token (every read of the block then takes stored rows; the mask and the scores
// stay logical). Without a list (pages == nullptr) a block and its rows are the logical ones.
struct PageList {
  const int64_t* pages = nullptr;  // (B, Hk, npages) int64, contiguous
  int64_t page = 0, npages = 0;
  at::Tensor held;
};

// `pages` checked (int64 (B, Hk, k) on CPU, k·page ≥ n, page a multiple of kivi, every entry a whole page of the
// `stored` rows every coded tensor holds) and bound; ValueError naming it otherwise.
inline PageList bind_pages(const char* op, const c10::optional<at::Tensor>& pages, int64_t page, int64_t B,
                           int64_t Hk, int64_t n, int64_t kivi, int64_t stored) {
  PageList pl;
  if (!pages.has_value()) {
    TORCH_CHECK_VALUE(page == 0, op, ": page=", page, " without pages");
    return pl;
  }
  const at::Tensor& t = *pages;
  TORCH_CHECK_VALUE(page > 0 && (kivi == 0 || page % kivi == 0), op, ": page=", page,
                    " must be positive and a multiple of key_channel_group=", kivi);
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 3 && t.size(0) == B &&
                        t.size(1) == Hk && t.size(2) * page >= n,
                    op, ": pages must be an int64 CPU tensor (B=", B, ", Hk=", Hk, ", k) with k·page ≥ n=", n,
                    ", got ", t.scalar_type(), " ", t.sizes());
  pl.held = t.contiguous();
  const int64_t* pp = pl.held.data_ptr<int64_t>();
  for (int64_t i = 0; i < pl.held.numel(); ++i)
    TORCH_CHECK_VALUE(pp[i] >= 0 && pp[i] < stored / page, op, ": pages[", i, "] = ", pp[i], " is outside the ",
                      stored / page, " whole pages the codes hold");
  pl.pages = pp;
  pl.page = page;
  pl.npages = t.size(2);
  return pl;
}

// the block of logical rows [t0, t0 + m) of (b, h): m clipped at t0's page, the stored row of t0 returned
inline int64_t paged_block(const PageList& pl, int64_t Hk, int64_t b, int64_t h, int64_t t0, int64_t& m) {
  if (!pl.pages) return t0;
  m = std::min(m, pl.page - t0 % pl.page);
  return pl.pages[(b * Hk + h) * pl.npages + t0 / pl.page] * pl.page + t0 % pl.page;
}

struct TaskRange {
  int64_t begin, end;
  const float* mask;
};
inline TaskRange start_task(const Common& a, int64_t len, int64_t b, int64_t h, int64_t s, int64_t S, int64_t T,
                            float* q, float* acc, float* m, float* l) {
  const int64_t blocks = (len + T - 1) / T, per = (blocks + S - 1) / S;
  const float* qsrc = a.q + ((b * a.Hk + h) * a.G) * a.D;
  for (int64_t i = 0; i < a.G * a.D; ++i) q[i] = qsrc[i] * a.scaling;
  std::fill(acc, acc + a.G * a.D, 0.f);
  for (int64_t j = 0; j < a.G; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
  }
  return {std::min(len, s * per * T), std::min(len, (s + 1) * per * T), a.mask ? a.mask + b * a.mask_bs : nullptr};
}

// out[j·ng + g] = Σ of q_j over channel group g (groups of gs; asymmetric keys: the zero-points' weight)
inline void group_sums(const float* q, int64_t G, int64_t D, int64_t gs, float* out) {
  const int64_t ng = D / gs;
  for (int64_t j = 0; j < G; ++j)
    for (int64_t g = 0; g < ng; ++g) {
      float z = 0.f;
      for (int64_t i = g * gs; i < (g + 1) * gs; ++i) z += q[j * D + i];
      out[j * ng + g] = z;
    }
}

// The instruction set of an op with one vector path (AVX2 + FMA + F16C) and a scalar fallback: the best the CPU
// has, capped to scalar by KVSLIM_ISA=scalar or the op's set_isa. An op keeps one in a function-local static.
inline bool cpu_avx2_fma_f16c() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

class Avx2OrScalar {
 public:
  Avx2OrScalar() {
    const char* cap = std::getenv("KVSLIM_ISA");
    scalar_.store(!cpu_avx2_fma_f16c() || (cap != nullptr && std::string(cap) == "scalar"));
  }
  std::string isa() const { return scalar_.load() ? "scalar" : "avx2"; }
  // select "avx2" or "scalar" (tests run both in one process); returns the previous one. fn: the op's set_isa
  // name, for the errors
  std::string set(const char* fn, const std::string& isa) {
    TORCH_CHECK_VALUE(isa == "scalar" || isa == "avx2", fn, ": isa must be 'avx2' or 'scalar', got '", isa, "'");
    TORCH_CHECK_VALUE(isa == "scalar" || cpu_avx2_fma_f16c(), fn, ": this CPU has no AVX2 + FMA + F16C");
    const std::string previous = this->isa();
    scalar_.store(isa == "scalar");
    return previous;
  }

 private:
  std::atomic<bool> scalar_{false};
};

// splits of the sequence when batch × KV heads would leave threads idle (flash-decoding)
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

// merge the S splits of row j of task group g exactly (weights exp(m_s − M), denominator Σ l_s exp(m_s − M)):
// split s of the group holds rows of width W at part_acc[((g·S + s)·rows + j)·W], its max / sum at
// part_m / part_l[(g·S + s)·rows + j]; writes o (W) and *lse. w: S floats of scratch.
inline void merge_row(const float* part_acc, const float* part_m, const float* part_l, int64_t S, int64_t rows,
                      int64_t W, int64_t g, int64_t j, float* w, float* o, float* lse) {
  float M = -INFINITY;
  for (int64_t s = 0; s < S; ++s) M = std::max(M, part_m[(g * S + s) * rows + j]);
  float den = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    const float ms = part_m[(g * S + s) * rows + j];
    w[s] = ms == -INFINITY ? 0.f : std::exp(ms - M);
    den += w[s] * part_l[(g * S + s) * rows + j];
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  std::fill(o, o + W, 0.f);
  for (int64_t s = 0; s < S; ++s) {
    const float f = w[s] * inv;
    if (f == 0.f) continue;
    const float* p = part_acc + ((g * S + s) * rows + j) * W;
    for (int64_t i = 0; i < W; ++i) o[i] += f * p[i];
  }
  *lse = den > 0.f ? M + std::log(den) : -INFINITY;
}

// Run fn(a, b, h, split, S, acc, m, l, scratch) over every (sequence, KV head, split) with blocks of T tokens
// (S ≤ 0: auto), each writing an unnormalised accumulator (G, D) with its running max m and sum l (G); then
// normalise (S = 1) or merge the splits exactly (merge_row).
// out (B, Hk, G, D), lse (B, Hk, G).
template <class Scratch, class Args, class Fn>
void run_split_k(const Args& a, int64_t S, int64_t T, Fn fn, float* out, float* lse) {
  const int64_t BH = a.B * a.Hk, GD = a.G * a.D;
  if (S <= 0) S = auto_splits(BH, a.n, T);
  S = std::max<int64_t>(1, std::min<int64_t>(S, (a.n + T - 1) / T));
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
  at::parallel_for(0, BH * a.G, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(S);
    for (int64_t row = begin; row < end; ++row)
      merge_row(part_acc.data(), part_m.data(), part_l.data(), S, a.G, a.D, row / a.G, row % a.G, w.data(),
                out + row * a.D, lse + row);
  });
}

}  // namespace kvslim_decode
