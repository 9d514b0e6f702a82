#include <torch/library.h>
#include <ATen/ATen.h>

#include "../tree_checks.h"

namespace vllm_ddtree {

at::Tensor tree_positions_cpu(const at::Tensor& seq_lens, const at::Tensor& depths) {
  check_tree_positions_args(seq_lens, depths, at::kCPU);
  const auto num_reqs = depths.size(0), num_nodes = depths.size(1);
  auto positions = at::empty({num_reqs, num_nodes}, seq_lens.options());
  const auto lens = seq_lens.contiguous();
  const auto deps = depths.to(at::kLong).contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* dep = deps.data_ptr<int64_t>();
  int64_t* out = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_reqs; ++r)
    for (int64_t i = 0; i < num_nodes; ++i)
      out[r * num_nodes + i] = len[r] + dep[r * num_nodes + i];
  return positions;
}

TORCH_LIBRARY_IMPL(vllm_ddtree, CPU, m) { m.impl("tree_positions", &tree_positions_cpu); }

}  // namespace vllm_ddtree
