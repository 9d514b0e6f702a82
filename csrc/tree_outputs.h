// The build op's outputs (layout: vllm_ddtree/tree.py), allocated the same way on every
// device.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "tree_checks.h"

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

// What verify_tree does before walking on either device: its arguments checked, its inputs
// contiguous, its outputs (accepted node indices, their count, the emitted tokens).
struct VerifyCall {
  int64_t R, N, D;  // requests, nodes, the deepest path
  at::Tensor tok, fc, ns, tgt;
  at::Tensor accepted, num_accepted, output_tokens;

  VerifyCall(const at::Tensor& token_ids, const at::Tensor& first_child,
             const at::Tensor& next_sibling, const at::Tensor& target_tokens, int64_t max_depth)
      : R((check_verify_args(token_ids, first_child, next_sibling, target_tokens, max_depth),
           token_ids.size(0))),
        N(token_ids.size(1)), D(max_depth), tok(token_ids.contiguous()),
        fc(first_child.contiguous()), ns(next_sibling.contiguous()),
        tgt(target_tokens.contiguous()), accepted(at::empty({R, D}, fc.options())),
        num_accepted(at::empty({R}, fc.options())),
        output_tokens(at::empty({R, D + 1}, tok.options())) {}

  std::tuple<at::Tensor, at::Tensor, at::Tensor> as_tuple() const {
    return {accepted, num_accepted, output_tokens};
  }
};

inline Widths checked_build_widths(const at::Tensor& root_tokens,
                                   const at::Tensor& topk_logprobs, const at::Tensor& topk_ids,
                                   int64_t budget, at::IntArrayRef width_list) {
  const Widths widths =
      make_widths(width_list, topk_logprobs.dim() == 3 ? topk_logprobs.size(2) : 0);
  check_build_args(root_tokens, topk_logprobs, topk_ids, budget, widths);
  return widths;
}

// What build_tree does before building on either device: its arguments checked (first),
// its inputs contiguous, its outputs allocated.
struct BuildCall {
  Widths widths;
  int64_t R, L, K, N;  // requests, drafter positions, top-k, nodes (budget + 1)
  at::Tensor logprobs, ids, roots;
  TreeOutputs out;

  BuildCall(const at::Tensor& root_tokens, const at::Tensor& topk_logprobs,
            const at::Tensor& topk_ids, int64_t budget, at::IntArrayRef width_list)
      : widths(checked_build_widths(root_tokens, topk_logprobs, topk_ids, budget, width_list)),
        R(topk_logprobs.size(0)), L(topk_logprobs.size(1)), K(topk_logprobs.size(2)),
        N(budget + 1), logprobs(topk_logprobs.contiguous()), ids(topk_ids.contiguous()),
        roots(root_tokens.contiguous()), out(R, N, ids, logprobs) {}
};

}  // namespace vllm_ddtree
