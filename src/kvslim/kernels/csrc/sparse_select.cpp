// kvslim::sparse_select — a sparse decode step's page choice in one call (kernels/sparse_select.py).
//
// For each sequence b and KV head h, with the G query heads q_g of the group (fp32) and the page boxes
// [c | r] (fp16 or fp32, converted to fp32 as they are read) of the first `n_pages` pages:
//
//   s_gp  = scaling · (q_g · c_p + |q_g| · r_p)              each head's bound on the page's best q·k
//   score = logsumexp_g (s_gp − logsumexp_p' s_gp')          the log of the group's summed estimated attentions
//   pages = the k best scores (page 0 first when force_first), ascending, then pages [n_pages, n_pages + rest)
//
// written into out[b, h, :k + rest] (int64). Ties go to the lower page (as the twin's stable ordering: the twin
// is kvslim.attention.sparse.page_scores + topk, tested against this op). One parallel region over B·H; nothing
// allocated per page but a G·P fp32 scratch per task.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

template <class T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

template <class T>
void select_task(const float* q, const T* box, int64_t G, int64_t D, int64_t n_pages, int64_t box_page_stride,
                 float scaling, int64_t k, bool force_first, int64_t rest, int64_t* out) {
  std::vector<float> s(static_cast<size_t>(G * n_pages));
  std::vector<float> row(static_cast<size_t>(2 * D));
  std::vector<float> qa(static_cast<size_t>(G * D));
  for (int64_t i = 0; i < G * D; ++i) qa[i] = std::fabs(q[i]);
  for (int64_t p = 0; p < n_pages; ++p) {
    const T* bp = box + p * box_page_stride;
    for (int64_t i = 0; i < 2 * D; ++i) row[i] = to_f(bp[i]);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      const float* ag = qa.data() + g * D;
      float acc = 0.f;
      for (int64_t i = 0; i < D; ++i) acc += qg[i] * row[i] + ag[i] * row[D + i];
      s[g * n_pages + p] = acc * scaling;
    }
  }
  std::vector<float> score(static_cast<size_t>(n_pages), -std::numeric_limits<float>::infinity());
  std::vector<float> m(static_cast<size_t>(n_pages), -std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {  // log-softmax of each head over the pages, then logsumexp over the heads
    float* sg = s.data() + g * n_pages;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n_pages; ++p) mx = std::max(mx, sg[p]);
    double sum = 0.0;
    for (int64_t p = 0; p < n_pages; ++p) sum += std::exp(static_cast<double>(sg[p] - mx));
    const float lse = mx + static_cast<float>(std::log(sum));
    for (int64_t p = 0; p < n_pages; ++p) {
      sg[p] -= lse;
      m[p] = std::max(m[p], sg[p]);
    }
  }
  for (int64_t p = 0; p < n_pages; ++p) {
    double sum = 0.0;
    for (int64_t g = 0; g < G; ++g) sum += std::exp(static_cast<double>(s[g * n_pages + p] - m[p]));
    score[p] = m[p] + static_cast<float>(std::log(sum));
  }
  if (force_first && n_pages > 0) score[0] = std::numeric_limits<float>::infinity();
  std::vector<int64_t> idx(static_cast<size_t>(n_pages));
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t kk = std::min(k, n_pages);
  auto better = [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::nth_element(idx.begin(), idx.begin() + kk, idx.end(), better);  // (kk may equal n_pages: a no-op)
  std::sort(idx.begin(), idx.begin() + kk);
  for (int64_t i = 0; i < kk; ++i) out[i] = idx[i];
  for (int64_t i = 0; i < rest; ++i) out[kk + i] = n_pages + i;
}

at::Tensor sparse_select_cpu(const at::Tensor& q, const at::Tensor& boxes, int64_t n_pages, int64_t k,
                             double scaling, bool force_first, int64_t rest) {
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
      if (half)
        select_task(qt, static_cast<const c10::Half*>(bp) + b * s0 + h * s1, G, D, n_pages, s2, sc, kk,
                    force_first, rest, ot);
      else
        select_task(qt, static_cast<const float*>(bp) + b * s0 + h * s1, G, D, n_pages, s2, sc, kk, force_first,
                    rest, ot);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("sparse_select(Tensor q, Tensor boxes, int n_pages, int k, float scaling, bool force_first, int rest) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("sparse_select", &sparse_select_cpu); }
