// csrc/cuda/tree_ops.cu, launch code and kernels unchanged, on the CPU emulator: its ops as
// a Python module (torch.utils.cpp_extension.load), plus kernels that break the emulator's
// rules, so a test can see each rule enforced.
#include <torch/extension.h>

#include "emulator.h"
// The CUDA source, compiled here as C++ (after the emulator's definitions).
#include "../../csrc/cuda/tree_ops.cu"

namespace {

__global__ void write_past_smem_kernel(int32_t bytes) {
  DDTREE_DYNAMIC_SMEM(smem);
  if (threadIdx.x == 0) smem[bytes] = 1;
}

__global__ void fill_smem_kernel(int32_t bytes) {
  DDTREE_DYNAMIC_SMEM(smem);
  for (int32_t i = threadIdx.x; i < bytes; i += blockDim.x) smem[i] = 1;
}

__global__ void divergent_sync_kernel() {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_positions", &vllm_ddtree::tree_positions_cuda);
  m.def("build_tree", &vllm_ddtree::build_tree_cuda, py::arg("root_tokens"),
        py::arg("topk_logprobs"), py::arg("topk_ids"), py::arg("budget"), py::arg("spine"),
        py::arg("widths") = std::vector<int64_t>{});
  m.def("verify_tree", &vllm_ddtree::verify_tree_cuda);
  m.def("compact_tree", [](const std::vector<at::Tensor>& kv_caches, const at::Tensor& hidden,
                           const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                           const at::Tensor& accepted, const at::Tensor& num_accepted) {
    vllm_ddtree::compact_tree_cuda(kv_caches, hidden, slot_mapping, query_start_loc, accepted,
                                   num_accepted);
  });
  m.def("take_build_counts", [] {  // (parallel, serial) since the last call
    return std::pair<int64_t, int64_t>{cuda_emulator::builds[0].exchange(0),
                                       cuda_emulator::builds[1].exchange(0)};
  });
  m.def("set_build_max_threads", [](int threads) { cuda_emulator::build_max_threads = threads; });
  m.def("write_past_smem", [](int32_t bytes) {
    DDTREE_LAUNCH(write_past_smem_kernel, 2, 32, bytes, nullptr)(bytes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  m.def("divergent_sync", [] {
    DDTREE_LAUNCH(divergent_sync_kernel, 1, 64, 0, nullptr)();
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  m.def("fill_smem", [](int32_t bytes, bool opt_in) {
    if (opt_in) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(fill_smem_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    }
    DDTREE_LAUNCH(fill_smem_kernel, 2, 32, bytes, nullptr)(bytes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}
