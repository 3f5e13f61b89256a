// kvslim::sparse_select — a sparse decode step's page choice in one call (kernels/sparse_select.py).
//
// For each sequence b and KV head h, with the G query heads q_g of the group (fp32) and the page boxes
// [c | r] (fp16 or fp32, converted to fp32 as they are read) of the first `n_pages` pages:
//
//   s_gp  = scaling · (q_g · c_p + |q_g| · r_p)              each head's bound on the page's best q·k
//   score = logsumexp_g (s_gp − logsumexp_p' s_gp')          the log of the group's summed estimated attentions
//   pages = the k best scores (page 0 first when force_first), ascending, then pages [n_pages, n_pages + rest)
//
// With `first` (B,) int64 (a left-padded batch: sequence b's first page holding a visible token) only pages
// [first[b], n_pages) are candidates (the softmax over pages taken over them; the padding pages' boxes not read),
// and `force` (B,) bool forces page first[b] (its real first tokens, the attention sinks) where set.
//
// written into out[b, h, :k + rest] (int64). Ties go to the lower page (as the twin's stable ordering: the twin
// is kvslim.attention.sparse.page_scores + topk, tested against this op). One parallel region over B·H; nothing
// allocated per page but a G·P fp32 scratch per task.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// Page p's [c | r] row (2D values) into fp32 `row`: F16C eight at a time where the CPU has it (the library is
// compiled without -march flags: the path is chosen at run time), else one by one.
__attribute__((target("avx2,fma,f16c"))) void bounds_avx2(const float* q, const float* qa, const void* box,
                                                          bool half, int64_t G, int64_t D, int64_t n_pages,
                                                          int64_t stride, float scaling, float* s, float* row) {
  for (int64_t p = 0; p < n_pages; ++p) {
    if (half) {
      const uint16_t* bp = static_cast<const uint16_t*>(box) + p * stride;
      for (int64_t i = 0; i < 2 * D; i += 8)
        _mm256_storeu_ps(row + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + i))));
    } else {
      const float* bp = static_cast<const float*>(box) + p * stride;
      for (int64_t i = 0; i < 2 * D; i += 8) _mm256_storeu_ps(row + i, _mm256_loadu_ps(bp + i));
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), _mm256_loadu_ps(row + i), acc);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qa + g * D + i), _mm256_loadu_ps(row + D + i), acc);
      }
      __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
      lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
      s[g * n_pages + p] = _mm_cvtss_f32(lo) * scaling;
    }
  }
}

void bounds_scalar(const float* q, const float* qa, const void* box, bool half, int64_t G, int64_t D,
                   int64_t n_pages, int64_t stride, float scaling, float* s, float* row) {
  for (int64_t p = 0; p < n_pages; ++p) {
    for (int64_t i = 0; i < 2 * D; ++i)
      row[i] = half ? static_cast<float>(static_cast<const c10::Half*>(box)[p * stride + i])
                    : static_cast<const float*>(box)[p * stride + i];
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t i = 0; i < D; ++i) acc += q[g * D + i] * row[i] + qa[g * D + i] * row[D + i];
      s[g * n_pages + p] = acc * scaling;
    }
  }
}

bool has_avx2() {
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
}

void select_task(const float* q, const void* box, bool half, int64_t G, int64_t D, int64_t n_pages,
                 int64_t box_page_stride, float scaling, int64_t k, bool force_first, int64_t rest, int64_t* out,
                 int64_t p0 = 0) {
  // candidates: pages [p0, n_pages) (p0 > 0: a padded sequence), their indices shifted back when written
  box = half ? static_cast<const void*>(static_cast<const c10::Half*>(box) + p0 * box_page_stride)
             : static_cast<const void*>(static_cast<const float*>(box) + p0 * box_page_stride);
  const int64_t all_pages = n_pages;
  n_pages -= p0;
  std::vector<float> s(static_cast<size_t>(G * n_pages));
  std::vector<float> row(static_cast<size_t>(2 * D));
  std::vector<float> qa(static_cast<size_t>(G * D));
  for (int64_t i = 0; i < G * D; ++i) qa[i] = std::fabs(q[i]);
  if (D % 8 == 0 && has_avx2())
    bounds_avx2(q, qa.data(), box, half, G, D, n_pages, box_page_stride, scaling, s.data(), row.data());
  else
    bounds_scalar(q, qa.data(), box, half, G, D, n_pages, box_page_stride, scaling, s.data(), row.data());
  std::vector<float> score(static_cast<size_t>(n_pages));
  if (G == 1) {  // one head: its log-softmax is its bound less a constant, the same ranking
    std::copy(s.begin(), s.end(), score.begin());
  } else {
    std::vector<float> m(static_cast<size_t>(n_pages), -std::numeric_limits<float>::infinity());
    for (int64_t g = 0; g < G; ++g) {  // log-softmax of each head over the pages, then logsumexp over the heads
      float* sg = s.data() + g * n_pages;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < n_pages; ++p) mx = std::max(mx, sg[p]);
      double sum = 0.0;
      for (int64_t p = 0; p < n_pages; ++p) sum += std::exp(sg[p] - mx);
      const float lse = mx + static_cast<float>(std::log(sum));
      for (int64_t p = 0; p < n_pages; ++p) {
        sg[p] -= lse;
        m[p] = std::max(m[p], sg[p]);
      }
    }
    for (int64_t p = 0; p < n_pages; ++p) {
      float sum = 0.f;
      for (int64_t g = 0; g < G; ++g) sum += std::exp(s[g * n_pages + p] - m[p]);
      score[p] = m[p] + std::log(sum);
    }
  }
  if (force_first && n_pages > 0) score[0] = std::numeric_limits<float>::infinity();
  std::vector<int64_t> idx(static_cast<size_t>(n_pages));
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t kk = std::min(k, n_pages);
  auto better = [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::nth_element(idx.begin(), idx.begin() + kk, idx.end(), better);  // (kk may equal n_pages: a no-op)
  std::sort(idx.begin(), idx.begin() + kk);
  for (int64_t i = 0; i < kk; ++i) out[i] = idx[i] + p0;
  for (int64_t i = 0; i < rest; ++i) out[kk + i] = all_pages + i;
}

at::Tensor sparse_select_cpu(const at::Tensor& q, const at::Tensor& boxes, int64_t n_pages, int64_t k,
                             double scaling, bool force_first, int64_t rest, const c10::optional<at::Tensor>& first,
                             const c10::optional<at::Tensor>& force) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
                    "kvslim::sparse_select: q must be a contiguous (B, H, G, D) fp32 tensor, got ", q.sizes(), " ",
                    q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(boxes.dim() == 4 && boxes.size(0) == B && boxes.size(1) == H && boxes.size(3) == 2 * D &&
                        boxes.stride(3) == 1 &&
                        (boxes.scalar_type() == at::kHalf || boxes.scalar_type() == at::kFloat),
                    "kvslim::sparse_select: boxes must be (B, H, pages, 2D) fp16/fp32 with unit last stride, got ",
                    boxes.sizes(), " ", boxes.scalar_type());
  TORCH_CHECK_VALUE(n_pages >= 0 && n_pages <= boxes.size(2), "kvslim::sparse_select: n_pages=", n_pages,
                    " outside the boxes' ", boxes.size(2), " pages");
  TORCH_CHECK_VALUE(k >= 1 && rest >= 0, "kvslim::sparse_select: k must be >= 1 and rest >= 0, got ", k, ", ", rest);
  const int64_t kk = std::min(k, n_pages);
  const bool padded = first.has_value() && first->defined();
  TORCH_CHECK_VALUE(padded == (force.has_value() && force->defined()),
                    "kvslim::sparse_select: first and force come together");
  at::Tensor first_c, force_c;
  const int64_t* fp = nullptr;
  const bool* fo = nullptr;
  if (padded) {
    TORCH_CHECK_VALUE(first->device().is_cpu() && first->scalar_type() == at::kLong && first->dim() == 1 &&
                          first->size(0) == B && force->device().is_cpu() && force->scalar_type() == at::kBool &&
                          force->dim() == 1 && force->size(0) == B,
                      "kvslim::sparse_select: first must be int64 (B=", B, ",) and force bool (B,) on CPU, got ",
                      first->sizes(), " ", first->scalar_type(), " and ", force->sizes(), " ", force->scalar_type());
    first_c = first->contiguous();
    force_c = force->contiguous();
    fp = first_c.data_ptr<int64_t>();
    fo = force_c.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(fp[b] >= 0 && n_pages - fp[b] >= kk, "kvslim::sparse_select: first[", b, "] = ", fp[b],
                        " leaves fewer than k=", kk, " of the ", n_pages, " pages");
  }
  at::Tensor out = at::empty({B, H, kk + rest}, q.options().dtype(at::kLong));
  const float* qp = q.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t s0 = boxes.stride(0), s1 = boxes.stride(1), s2 = boxes.stride(2);
  const bool half = boxes.scalar_type() == at::kHalf;
  const void* bp = boxes.data_ptr();
  const float sc = static_cast<float>(scaling);
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / H, h = t % H;
      const float* qt = qp + t * G * D;
      int64_t* ot = op + t * (kk + rest);
      const void* bt = half ? static_cast<const void*>(static_cast<const c10::Half*>(bp) + b * s0 + h * s1)
                            : static_cast<const void*>(static_cast<const float*>(bp) + b * s0 + h * s1);
      if (padded)
        select_task(qt, bt, half, G, D, n_pages, s2, sc, kk, fo[b], rest, ot, fp[b]);
      else
        select_task(qt, bt, half, G, D, n_pages, s2, sc, kk, force_first, rest, ot);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("sparse_select(Tensor q, Tensor boxes, int n_pages, int k, float scaling, bool force_first, int rest, "
        "Tensor? first=None, Tensor? force=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("sparse_select", &sparse_select_cpu); }
