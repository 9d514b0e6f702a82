// Argument checks shared by the CPU and CUDA implementations. They look at shapes, dtypes
// and devices only (never at data, which would sync with a device): a bad argument is an
// error naming it; bad values inside tensors are guarded where they are used.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "tree.h"

namespace vllm_ddtree {

constexpr int64_t kMaxBudget = 1024;  // keep in sync with vllm_ddtree/tree.py MAX_BUDGET
static_assert(kMaxBudget < 2048, "a Candidate packs parent and rank in 11 bits each");

#define DDTREE_CHECK_ARG(cond, op, name, ...) \
  TORCH_CHECK(cond, op, ": argument '", name, "' ", __VA_ARGS__)

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                         std::initializer_list<at::ScalarType> dtypes,
                         const at::Device& device) {
  DDTREE_CHECK_ARG(t.dim() == dim, op, name, "must be ", dim, "-D, got shape ", t.sizes());
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  DDTREE_CHECK_ARG(ok, op, name, "has wrong dtype ", t.scalar_type());
  DDTREE_CHECK_ARG(t.device() == device, op, name, "must be on ", device, ", got ",
                   t.device());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                       int64_t want, const char* what) {
  DDTREE_CHECK_ARG(t.size(dim) == want, op, name, "has size ", t.size(dim), " in dim ", dim,
                   ", expected ", want, " (", what, ")");
}

inline void check_tree_positions_args(const at::Tensor& seq_lens, const at::Tensor& depths) {
  const char* op = "tree_positions";
  check_tensor(op, "seq_lens", seq_lens, 1, {at::kLong}, seq_lens.device());
  check_tensor(op, "depths", depths, 2, {at::kInt, at::kLong}, seq_lens.device());
  check_size(op, "depths", depths, 0, seq_lens.size(0), "one row per request");
}

// Number of prefixes of depth <= L over K ranks, saturated at kMaxBudget + 1.
inline int64_t num_prefixes(int64_t L, int64_t K) {
  int64_t total = 0, level = 1;
  for (int64_t d = 0; d < L && total <= kMaxBudget; ++d) {
    level = std::min<int64_t>(level * K, kMaxBudget + 1);
    total += level;
  }
  return std::min<int64_t>(total, kMaxBudget + 1);
}

// Nodes JetSpec's build can place: sum over depths d < L of prod_{i <= d} w(i), saturated.
inline int64_t num_expanded_nodes(int64_t L, const Widths& widths) {
  int64_t total = 0, level = 1;
  for (int64_t d = 0; d < L && total <= kMaxBudget; ++d) {
    level = std::min<int64_t>(level * widths.at(static_cast<int32_t>(d)), kMaxBudget + 1);
    total += level;
  }
  return std::min<int64_t>(total, kMaxBudget + 1);
}

// The build's per-depth widths from the op's argument (empty: best-first), checked.
inline Widths make_widths(at::IntArrayRef widths, int64_t K) {
  const char* op = "build_tree";
  DDTREE_CHECK_ARG(static_cast<int64_t>(widths.size()) <= kMaxWidths, op, "widths",
                   "takes at most ", kMaxWidths, " per-depth widths (the last one repeats), got ",
                   widths.size());
  Widths w{};
  w.n = static_cast<int32_t>(widths.size());
  for (size_t d = 0; d < widths.size(); ++d) {
    DDTREE_CHECK_ARG(widths[d] >= 1 && widths[d] <= K, op, "widths", "entry ", d, " is ",
                     widths[d], ": must be in [1, ", K, "] (the top-k's ranks)");
    w.w[d] = static_cast<int32_t>(widths[d]);
  }
  return w;
}

inline void check_build_args(const at::Tensor& root_tokens, const at::Tensor& topk_logprobs,
                             const at::Tensor& topk_ids, int64_t budget,
                             const Widths& widths) {
  const char* op = "build_tree";
  const auto dev = topk_logprobs.device();
  check_tensor(op, "topk_logprobs", topk_logprobs, 3, {at::kFloat}, dev);
  check_tensor(op, "topk_ids", topk_ids, 3, {at::kLong}, dev);
  check_tensor(op, "root_tokens", root_tokens, 1, {at::kLong}, dev);
  DDTREE_CHECK_ARG(topk_ids.sizes() == topk_logprobs.sizes(), op, "topk_ids",
                   "must have the shape of topk_logprobs ", topk_logprobs.sizes(), ", got ",
                   topk_ids.sizes());
  check_size(op, "root_tokens", root_tokens, 0, topk_logprobs.size(0), "one per request");
  const int64_t L = topk_logprobs.size(1), K = topk_logprobs.size(2);
  DDTREE_CHECK_ARG(L >= 1 && K >= 1, op, "topk_logprobs",
                   "needs at least one depth and one rank, got shape ", topk_logprobs.sizes());
  DDTREE_CHECK_ARG(budget >= 1 && budget <= kMaxBudget, op, "budget", "must be in [1, ",
                   kMaxBudget, "], got ", budget);
  DDTREE_CHECK_ARG(budget <= num_prefixes(L, K), op, "budget", "is ", budget,
                   ", but depth ", L, " with top-", K, " allows only ", num_prefixes(L, K),
                   " nodes");
  if (widths.n > 0) {
    DDTREE_CHECK_ARG(budget <= num_expanded_nodes(L, widths), op, "budget", "is ", budget,
                     ", but depth ", L, " with these widths allows only ",
                     num_expanded_nodes(L, widths), " nodes");
  }
}

inline void check_verify_args(const at::Tensor& token_ids, const at::Tensor& first_child,
                              const at::Tensor& next_sibling, const at::Tensor& target_tokens,
                              int64_t max_depth) {
  const char* op = "verify_tree";
  const auto dev = token_ids.device();
  check_tensor(op, "token_ids", token_ids, 2, {at::kLong}, dev);
  check_tensor(op, "first_child", first_child, 2, {at::kInt}, dev);
  check_tensor(op, "next_sibling", next_sibling, 2, {at::kInt}, dev);
  check_tensor(op, "target_tokens", target_tokens, 2, {at::kLong}, dev);
  DDTREE_CHECK_ARG(token_ids.size(1) >= 1, op, "token_ids", "needs the root column");
  for (auto [name, t] : {std::pair{"first_child", &first_child},
                         std::pair{"next_sibling", &next_sibling},
                         std::pair{"target_tokens", &target_tokens}}) {
    DDTREE_CHECK_ARG(t->sizes() == token_ids.sizes(), op, name, "must have the shape of ",
                     "token_ids ", token_ids.sizes(), ", got ", t->sizes());
  }
  DDTREE_CHECK_ARG(max_depth >= 0 && max_depth <= kMaxBudget, op, "max_depth",
                   "must be in [0, ", kMaxBudget, "], got ", max_depth);
}

inline void check_compact_args(at::TensorList kv_caches,
                               const at::Tensor& hidden_states, const at::Tensor& slot_mapping,
                               const at::Tensor& query_start_loc, const at::Tensor& accepted,
                               const at::Tensor& num_accepted) {
  const char* op = "compact_tree";
  const auto dev = accepted.device();
  check_tensor(op, "accepted", accepted, 2, {at::kInt}, dev);
  check_tensor(op, "num_accepted", num_accepted, 1, {at::kInt}, dev);
  check_tensor(op, "query_start_loc", query_start_loc, 1, {at::kInt, at::kLong}, dev);
  check_tensor(op, "slot_mapping", slot_mapping, 1, {at::kLong}, dev);
  check_size(op, "num_accepted", num_accepted, 0, accepted.size(0), "one per request");
  check_size(op, "query_start_loc", query_start_loc, 0, accepted.size(0) + 1,
             "num_reqs + 1 offsets");
  // On CUDA an empty map reads as "no map" (hidden rows): a cache would take token indices
  // for slots.
  DDTREE_CHECK_ARG(kv_caches.empty() || slot_mapping.numel() > 0, op, "slot_mapping",
                   "must not be empty when kv_caches are given");
  for (const auto& cache : kv_caches) {
    DDTREE_CHECK_ARG(cache.dim() == 4, op, "kv_caches",
                     "entries must be 4-D [num_blocks, num_kv_heads, block_size, C], got ",
                     cache.sizes());
    DDTREE_CHECK_ARG(cache.device() == dev, op, "kv_caches", "must be on ", dev, ", got ",
                     cache.device());
  }
  if (hidden_states.numel() > 0) {
    DDTREE_CHECK_ARG(hidden_states.dim() == 2, op, "hidden_states",
                     "must be 2-D [num_tokens, hidden] or empty, got ", hidden_states.sizes());
    DDTREE_CHECK_ARG(hidden_states.device() == dev, op, "hidden_states", "must be on ", dev,
                     ", got ", hidden_states.device());
  }
}

}  // namespace vllm_ddtree
