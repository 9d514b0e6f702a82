// Argument checks shared by the CPU and CUDA implementations: a bad argument is a clear
// error naming it, never an out-of-bounds access.
#pragma once
#include <ATen/ATen.h>

namespace vllm_ddtree {

inline void check_tree_positions_args(const at::Tensor& seq_lens, const at::Tensor& depths,
                                      at::DeviceType device) {
  TORCH_CHECK(seq_lens.dim() == 1, "tree_positions: seq_lens must be 1-D [num_reqs], got ",
              seq_lens.sizes());
  TORCH_CHECK(depths.dim() == 2, "tree_positions: depths must be 2-D [num_reqs, num_nodes], got ",
              depths.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong, "tree_positions: seq_lens must be int64, got ",
              seq_lens.scalar_type());
  TORCH_CHECK(depths.scalar_type() == at::kInt || depths.scalar_type() == at::kLong,
              "tree_positions: depths must be int32 or int64, got ", depths.scalar_type());
  TORCH_CHECK(depths.size(0) == seq_lens.size(0), "tree_positions: depths has ",
              depths.size(0), " rows but seq_lens has ", seq_lens.size(0), " requests");
  TORCH_CHECK(seq_lens.device().type() == device && depths.device() == seq_lens.device(),
              "tree_positions: seq_lens and depths must be on the same ", device,
              " device, got ", seq_lens.device(), " and ", depths.device());
}

}  // namespace vllm_ddtree
