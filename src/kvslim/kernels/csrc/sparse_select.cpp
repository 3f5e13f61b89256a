// kvslim::sparse_select — a sparse decode step's page choice in one call (kernels/sparse_select.py).
//
// For each sequence b and KV head h, with the G query heads q_g of the group (fp32) and the page boxes
// [c | r] of the first `n_pages` pages, converted to fp32 as they are read: fp16 or fp32 values, or int8 codes
// with `scales` (B, H, pages, 2D / group) fp16, one per `group` channels (the library's format,
// kvslim/caches/sparse.py: c relative to a per-head reference, which shifts every page's bound by one constant
// per query head and so leaves the ranking as it is):
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
// allocated per page but a G·P fp32 scratch and the top-k's keys per task.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "sparse_select_body.h"

namespace {

at::Tensor sparse_select_cpu(const at::Tensor& q, const at::Tensor& boxes, int64_t n_pages, int64_t k,
                             double scaling, bool force_first, int64_t rest, const c10::optional<at::Tensor>& first,
                             const c10::optional<at::Tensor>& force, const c10::optional<at::Tensor>& scales) {
  return kvslim_select::select("kvslim::sparse_select", q, boxes, n_pages, k, scaling, force_first, rest, first, force,
                               scales);
}

// cap the selection's instruction set ("scalar", "avx2", "avx512"; the CPU's best is used when it is lower); returns
// the previous cap. Tests compare the paths in one process.
std::string sparse_select_set_isa(const std::string& isa) {
  static const char* const names[] = {"scalar", "avx2", "avx512"};
  int level = -1;
  for (int i = 0; i < 3; ++i)
    if (isa == names[i]) level = i;
  TORCH_CHECK_VALUE(level >= 0, "kvslim::sparse_select_set_isa: isa must be one of 'scalar', 'avx2', 'avx512', got '",
                    isa, "'");
  return names[kvslim_select::isa_cap().exchange(level)];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvslim, m) {
  m.def("sparse_select(Tensor q, Tensor boxes, int n_pages, int k, float scaling, bool force_first, int rest, "
        "Tensor? first=None, Tensor? force=None, Tensor? scales=None) -> Tensor");
  m.def("sparse_select_set_isa(str isa) -> str", &sparse_select_set_isa);
}

TORCH_LIBRARY_IMPL(kvslim, CPU, m) { m.impl("sparse_select", &sparse_select_cpu); }
