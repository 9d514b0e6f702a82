#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "../tree_checks.h"

namespace vllm_ddtree {

template <typename depth_t>
__global__ void tree_positions_kernel(const int64_t* __restrict__ seq_lens,
                                      const depth_t* __restrict__ depths,
                                      int64_t* __restrict__ positions, int64_t num_nodes,
                                      int64_t total) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx < total) positions[idx] = seq_lens[idx / num_nodes] + static_cast<int64_t>(depths[idx]);
}

// No host sync and no data-dependent shape: safe inside a captured CUDA graph.
at::Tensor tree_positions_cuda(const at::Tensor& seq_lens, const at::Tensor& depths) {
  check_tree_positions_args(seq_lens, depths, at::kCUDA);
  const c10::cuda::CUDAGuard guard(seq_lens.device());
  const auto lens = seq_lens.contiguous();
  const auto deps = depths.contiguous();
  auto positions = at::empty(deps.sizes(), lens.options());
  const int64_t total = deps.numel();
  if (total == 0) return positions;
  constexpr int threads = 256;
  const auto blocks = static_cast<unsigned int>((total + threads - 1) / threads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (deps.scalar_type() == at::kInt) {
    tree_positions_kernel<int32_t><<<blocks, threads, 0, stream>>>(
        lens.data_ptr<int64_t>(), deps.data_ptr<int32_t>(), positions.data_ptr<int64_t>(),
        deps.size(1), total);
  } else {
    tree_positions_kernel<int64_t><<<blocks, threads, 0, stream>>>(
        lens.data_ptr<int64_t>(), deps.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
        deps.size(1), total);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return positions;
}

TORCH_LIBRARY_IMPL(vllm_ddtree, CUDA, m) { m.impl("tree_positions", &tree_positions_cuda); }

}  // namespace vllm_ddtree
