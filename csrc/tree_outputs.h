// The build op's outputs (layout: vllm_ddtree/tree.py), allocated the same way on every
// device.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace vllm_ddtree {

using TreeTensors =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor>;

struct TreeOutputs {
  at::Tensor token_ids, parents, depths, first_child, next_sibling, mask, scores;

  // `ids` and `logprobs` give the options (device, dtype) of the token and score outputs.
  TreeOutputs(int64_t R, int64_t N, const at::Tensor& ids, const at::Tensor& logprobs) {
    const auto i32 = logprobs.options().dtype(at::kInt);
    token_ids = at::empty({R, N}, ids.options());
    parents = at::empty({R, N}, i32);
    depths = at::empty({R, N}, i32);
    first_child = at::empty({R, N}, i32);
    next_sibling = at::empty({R, N}, i32);
    mask = at::empty({R, N, (N + 31) / 32}, i32);
    scores = at::empty({R, N}, logprobs.options());
  }

  TreeTensors as_tuple() const {
    return {token_ids, parents, depths, first_child, next_sibling, mask, scores};
  }
};

}  // namespace vllm_ddtree
