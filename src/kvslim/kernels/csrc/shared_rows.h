// Decode attention of h query heads over rows shared by all heads, in one pass over the rows
// (used by slim_decode.cpp and encdec_decode.cpp).
//
//   u[b, j, :] = Σ_t softmax_t(scaling · q[b, j] · keys_j(row_t) + mask[b, t]) · vrow_t        (B, h, c)
//   lse[b, j]  = log Σ_t exp(scaling · q[b, j] · keys_j(row_t) + mask[b, t])                      (B, h)
//
// keys_j(row) is the slice [j·koff, j·koff + L) of the row (slim K-cache: koff = L = dk, RoPE optionally applied
// on the fly) or the whole row (koff = 0, L = c: encoder-decoder cross-attention with absorbed queries).
// vrow is the row itself (un-rotated on the fly for rotated RoPE storage). Parallel over batch × splits of the
// sequence (flash-decoding: per-split partial (acc, max, sum), merged exactly with log-sum-exp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "decode_common.h"
#include "vec_slim.h"

#pragma GCC visibility push(hidden)  // internal: no PLT calls between the kernel's own functions

namespace kvslim_rows {

struct Args {
  const void* rows = nullptr;  // (B, n, c) fp32 or bf16, element (b, t, k) at b·bs + t·rs + k
  bool bf16 = false;
  int64_t B = 0, n = 0, c = 0, rs = 0, bs = 0;
  const float* q = nullptr;  // (B, h, L) contiguous per batch: element (b, j, i) at b·qbs + j·L + i
  int64_t h = 0, L = 0, qbs = 0, koff = 0;
  int64_t dk = 0, e = 0, R = 0;  // RoPE: first R channels of each of the h dk-wide heads in columns [0, e)
  bool rotated = false;
  const float *cos = nullptr, *sin = nullptr;  // (B|1, n, R): (b, t, i) at b·cos_bs + t·cos_rs + i
  int64_t cos_bs = 0, cos_rs = 0, sin_bs = 0, sin_rs = 0;
  const float* mask = nullptr;  // (B|1, n) additive: (b, t) at b·mask_bs + t
  int64_t mask_bs = 0;
  const int64_t* lengths = nullptr;  // (B,) rows to read per sequence (1 ≤ len ≤ n), or all n
  float scaling = 1.f;
  // optional per-head maps folded into the op (fp32, contiguous, checked by the op):
  const float* absorb = nullptr;  // (h, qdk, L): the pass uses q[b, j] = Σ_i qraw[b, j, i] · absorb[j, i, :]
  bool absorb_dk_last = false;    // absorb is (h, L, qdk) instead
  const float* qraw = nullptr;    // (B, h, qdk) raw queries (with `absorb`)
  int64_t qdk = 0;
  const float* vmap = nullptr;  // out[b, j] = u[b, j] · vmap[j] + vbias[j]: vmap (h, c, odk), or (h, odk, c) with
  bool vmap_rows_out = false;   // vmap_rows_out
  int64_t odk = 0;
  const float* vbias = nullptr;  // (h, odk) or none
};

struct Scratch {
  int64_t T;
  std::vector<float> sc, ubuf;  // scores (h, T); fp32 / un-rotated rows (T, c)
  Scratch(const Args& a, int64_t T_) : T(T_), sc(a.h * T_) {
    if (a.bf16 || (a.R > 0 && a.rotated)) ubuf.resize(T_ * a.c);
  }
};

// rows per chunk: about 96 KiB of fp32 rows (L2-resident between the score and the accumulation pass)
inline int64_t chunk_rows(int64_t c) { return std::clamp<int64_t>((96 * 1024 / 4) / std::max<int64_t>(c, 1) / 4 * 4, 8, 256); }

}  // namespace kvslim_rows

namespace kvslim_rows {
namespace scalar {
using V = kvslim_vec::VecScalar;
#include "shared_rows_body.h"
}  // namespace scalar
}  // namespace kvslim_rows

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace kvslim_rows {
namespace avx2 {
using V = kvslim_vec::VecAVX2;
#include "shared_rows_body.h"
}  // namespace avx2
}  // namespace kvslim_rows
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace kvslim_rows {
namespace avx512 {
using V = kvslim_vec::VecAVX512;
#include "shared_rows_body.h"
}  // namespace avx512
}  // namespace kvslim_rows
#pragma GCC pop_options

namespace kvslim_rows {

using TaskFn = void (*)(const Args&, int64_t, int64_t, int64_t, float*, float*, float*, Scratch&);
using AbsorbFn = void (*)(const float*, const float*, bool, int64_t, int64_t, int64_t, float*);
using MapFn = void (*)(const float*, const float*, bool, int64_t, int64_t, const float*, float*);

// the instruction set: KVSLIM_ISA=scalar|avx2|avx512 caps it (tests), else the best the CPU has
inline const char* isa_name() {
  static const char* name = [] {
    __builtin_cpu_init();
    const char* cap = std::getenv("KVSLIM_ISA");
    const std::string want = cap ? cap : "avx512";
    if (want == "avx512" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return "avx512";
    if (want != "scalar" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
    return "scalar";
  }();
  return name;
}

struct Fns {
  TaskFn task;
  AbsorbFn absorb;
  MapFn map;
};

inline Fns fns() {
  const std::string isa = isa_name();
  if (isa == "avx512") return {avx512::run_task, avx512::absorb_seq, avx512::map_head};
  if (isa == "avx2") return {avx2::run_task, avx2::absorb_seq, avx2::map_head};
  return {scalar::run_task, scalar::absorb_seq, scalar::map_head};
}

// splits per sequence: enough tasks for every thread when the batch is small, ≥ 2 chunks per split
inline int64_t auto_splits(int64_t B, int64_t n, int64_t T) {
  const int64_t threads = at::get_num_threads();
  if (B % threads == 0 && B >= threads) return 1;
  const int64_t want = (4 * threads + B - 1) / B;
  return std::max<int64_t>(1, std::min<int64_t>(want, (n + 2 * T - 1) / (2 * T)));
}

// u (B, h, c) and lse (B, h), both fp32 contiguous; S = splits per sequence (0: automatic). With a.vmap, `out`
// (B, h, odk) receives the mapped head outputs and `u` may be null (an internal buffer is used). With a.absorb,
// the queries are absorbed first. A batch that fills the threads (S = 1) runs in one parallel region, each task
// absorbing, normalising and mapping its own sequence: on a loaded machine every region costs a wake-up of the
// other threads. A small batch (fewer tasks than threads, or split sequences) absorbs and maps in regions of
// their own over (sequence, head), so that the map weights are read by every thread.
inline void run(const Args& a0, int64_t S, float* u, float* lse, float* out = nullptr) {
  const int64_t T = chunk_rows(a0.c);
  if (S <= 0) S = auto_splits(a0.B, a0.n, T);
  S = std::max<int64_t>(1, std::min<int64_t>(S, (a0.n + T - 1) / T));
  const Fns f = fns();
  Args a = a0;
  const int64_t hc = a.h * a.c, hL = a.h * a.L;
  // Fewer tasks than threads (a small batch): the per-head maps run in their own regions over (sequence, head),
  // so both threads read the map weights (h·qdk·L and h·c·odk floats, cold in a model: ~0.6 MB each for Whisper-
  // tiny) instead of one thread alone; otherwise each task maps its own sequence inside the one region.
  const bool small = a.B * S < at::get_num_threads() || S > 1;
  std::vector<float> qbuf, ubuf;
  if (a.absorb) {
    qbuf.resize(a.B * hL);
    a.q = qbuf.data();
    a.qbs = hL;
    if (small)
      at::parallel_for(0, a.B * a.h, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bj = begin; bj < end; ++bj) {
          const int64_t b = bj / a.h, j = bj % a.h;
          f.absorb(a.qraw + (b * a.h + j) * a.qdk, a.absorb + j * a.qdk * a.L, a.absorb_dk_last, 1, a.qdk, a.L,
                   qbuf.data() + b * hL + j * a.L);
        }
      });
  }
  if (a.vmap && u == nullptr) {
    ubuf.resize(a.B * hc);
    u = ubuf.data();
  }
  auto map_seq = [&](int64_t b, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      f.map(u + b * hc + j * a.c, a.vmap + j * a.c * a.odk, a.vmap_rows_out, a.c, a.odk,
            a.vbias ? a.vbias + j * a.odk : nullptr, out + (b * a.h + j) * a.odk);
  };
  std::vector<float> part_acc, part_m(a.B * S * a.h), part_l(a.B * S * a.h);
  if (S > 1) part_acc.resize(a.B * S * hc);
  at::parallel_for(0, a.B * S, 1, [&](int64_t begin, int64_t end) {
    Scratch sp(a, T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / S, s = task % S;
      if (a.absorb && !small) f.absorb(a.qraw + b * a.h * a.qdk, a.absorb, a.absorb_dk_last, a.h, a.qdk, a.L, qbuf.data() + b * hL);
      float* acc = S > 1 ? part_acc.data() + task * hc : u + b * hc;
      float *m = part_m.data() + task * a.h, *l = part_l.data() + task * a.h;
      f.task(a, b, s, S, acc, m, l, sp);
      if (S == 1) {
        kvslim_decode::finish_rows(acc, m, l, lse + b * a.h, a.h, a.c);
        if (a.vmap && !small) map_seq(b, 0, a.h);
      }
    }
  });
  if (S == 1) {
    if (a.vmap && small)
      at::parallel_for(0, a.B * a.h, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bj = begin; bj < end; ++bj) map_seq(bj / a.h, bj % a.h, bj % a.h + 1);
      });
    return;
  }
  // merge the splits exactly (merge_row), then map: over (sequence, head) pairs in parallel when they carry maps
  // or the merge itself is large (it reads B·h·S·c floats, usually a few µs of work)
  const int64_t grain =
      a.vmap ? 1 : std::max<int64_t>(16, (int64_t{1} << 18) / std::max<int64_t>(S * a.c, 1));
  at::parallel_for(0, a.B * a.h, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(S);
    for (int64_t bj = begin; bj < end; ++bj) {
      const int64_t b = bj / a.h, j = bj % a.h;
      kvslim_decode::merge_row(part_acc.data(), part_m.data(), part_l.data(), S, a.h, a.c, b, j, w.data(),
                               u + b * hc + j * a.c, lse + bj);
      if (a.vmap) map_seq(b, j, j + 1);
    }
  });
}

}  // namespace kvslim_rows

namespace kvslim_rows {

// mask (B|1, n) fp32 and lengths (B,) int64 into Args (shared by both op families)
// the optional additive mask and per-sequence lengths: checked, kept alive by mask_keep / len_keep
inline void set_mask_lengths(Args& a, const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& lengths,
                             at::Tensor& mask_keep, at::Tensor& len_keep, const char* op) {
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK_VALUE(m.device().is_cpu() && m.scalar_type() == at::kFloat, op, ": mask must be float32 on CPU, got ",
                      m.scalar_type());
    TORCH_CHECK_VALUE(m.dim() == 2 && (m.size(0) == 1 || m.size(0) == a.B) && m.size(1) == a.n, op,
                      ": mask must be (1 or B=", a.B, ", n=", a.n, "), got ", m.sizes());
    mask_keep = m.stride(1) == 1 ? m : m.contiguous();
    a.mask = mask_keep.data_ptr<float>();
    a.mask_bs = mask_keep.size(0) == 1 ? 0 : mask_keep.stride(0);
  }
  if (lengths.has_value()) {
    const auto& l = *lengths;
    TORCH_CHECK_VALUE(l.device().is_cpu() && l.scalar_type() == at::kLong && l.dim() == 1 && l.size(0) == a.B, op,
                      ": lengths must be an int64 CPU tensor of shape (B=", a.B, ",), got ", l.scalar_type(), " ",
                      l.sizes());
    len_keep = l.contiguous();
    const int64_t* p = len_keep.data_ptr<int64_t>();
    for (int64_t b = 0; b < a.B; ++b)
      TORCH_CHECK_VALUE(p[b] >= 1 && p[b] <= a.n, op, ": lengths[", b, "] = ", p[b], " is outside [1, n=", a.n, "]");
    a.lengths = p;
  }
}

// an fp32 CPU tensor of exactly `shape`, made contiguous into `keep` (maps, queries, biases of the mapped ops)
inline const float* f32_exact(const at::Tensor& t, at::IntArrayRef shape, at::Tensor& keep, const char* op,
                              const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.sizes() == shape, op, ": ", name,
                    " must be a float32 CPU tensor of shape ", shape, ", got ", t.scalar_type(), " ", t.sizes(),
                    " on ", t.device());
  keep = t.contiguous();
  return keep.data_ptr<float>();
}

// rows (B, n, c) fp32/bf16 with unit column stride into Args
inline at::Tensor set_rows(Args& a, const at::Tensor& rows, const char* op, const char* name) {
  TORCH_CHECK_VALUE(rows.device().is_cpu() && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16),
                    op, ": ", name, " must be float32 or bfloat16 on CPU, got ", rows.scalar_type(), " on ",
                    rows.device());
  TORCH_CHECK_VALUE(rows.dim() == 3 && rows.size(1) >= 1 && rows.size(2) >= 1, op, ": ", name,
                    " must be (B, n ≥ 1, c ≥ 1), got ", rows.sizes());
  at::Tensor r = rows.stride(2) == 1 ? rows : rows.contiguous();
  a.rows = r.data_ptr();
  a.bf16 = r.scalar_type() == at::kBFloat16;
  a.B = r.size(0);
  a.n = r.size(1);
  a.c = r.size(2);
  a.rs = r.stride(1);
  a.bs = r.stride(0);
  return r;
}

}  // namespace kvslim_rows

#pragma GCC visibility pop
