// CPU implementations of the vllm_ddtree ops; they double as the oracle for the CUDA ones.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../tree.h"
#include "../tree_checks.h"
#include "../tree_outputs.h"

namespace vllm_ddtree {

at::Tensor tree_positions_cpu(const at::Tensor& seq_lens, const at::Tensor& depths) {
  check_tree_positions_args(seq_lens, depths);
  return seq_lens.unsqueeze(1) + depths.to(at::kLong);
}

TreeTensors build_tree_cpu(const at::Tensor& root_tokens, const at::Tensor& topk_logprobs,
                           const at::Tensor& topk_ids, int64_t budget, bool spine,
                           at::IntArrayRef width_list) {
  const BuildCall call(root_tokens, topk_logprobs, topk_ids, budget, width_list);
  const int64_t R = call.R, L = call.L, K = call.K, N = call.N, W = (N + 31) / 32;
  const Widths& widths = call.widths;
  const at::Tensor &lp = call.logprobs, &ids = call.ids, &roots = call.roots;
  const TreeOutputs& out = call.out;
  // Trees split across intra-op threads (setup.py builds with OpenMP, else this is serial)
  // in tasks of at least ~512 nodes, about 2 µs: smaller tasks cost more to hand out.
  const int64_t grain = std::max<int64_t>(1, 512 / N);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> heap(N);
    std::vector<int32_t> last_child(N);
    for (int64_t r = begin; r < end; ++r) {
      TreeRows rows{out.token_ids.data_ptr<int64_t>() + r * N,
                    out.parents.data_ptr<int32_t>() + r * N,
                    out.depths.data_ptr<int32_t>() + r * N,
                    out.first_child.data_ptr<int32_t>() + r * N,
                    out.next_sibling.data_ptr<int32_t>() + r * N,
                    out.scores.data_ptr<float>() + r * N, last_child.data()};
      build_tree_of(lp.data_ptr<float>() + r * L * K, L, K, widths, budget, spine,
                    roots.data_ptr<int64_t>()[r], heap.data(), rows);
      const int64_t* request_ids = ids.data_ptr<int64_t>() + r * L * K;
      for (int64_t i = 1; i < N; ++i) rows.token_ids[i] = request_ids[rows.token_ids[i]];
      // Parents precede children: a node's mask is its parent's plus its own bit.
      int32_t* m = out.mask.data_ptr<int32_t>() + r * N * W;
      std::memset(m, 0, W * sizeof(int32_t));
      m[0] = 1;
      for (int64_t i = 1; i < N; ++i) {
        std::memcpy(m + i * W, m + rows.parents[i] * W, W * sizeof(int32_t));
        m[i * W + i / 32] |= static_cast<int32_t>(1u << (i % 32));
      }
    }
  });
  return out.as_tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cpu(
    const at::Tensor& token_ids, const at::Tensor& first_child, const at::Tensor& next_sibling,
    const at::Tensor& target_tokens, int64_t max_depth) {
  const VerifyCall call(token_ids, first_child, next_sibling, target_tokens, max_depth);
  const int64_t R = call.R, N = call.N, D = call.D;
  const at::Tensor &tok = call.tok, &fc = call.fc, &ns = call.ns, &tgt = call.tgt;
  const at::Tensor &accepted = call.accepted, &num_accepted = call.num_accepted;
  const at::Tensor& output_tokens = call.output_tokens;
  for (int64_t r = 0; r < R; ++r) {
    num_accepted.data_ptr<int32_t>()[r] = verify_one_tree(
        tok.data_ptr<int64_t>() + r * N, fc.data_ptr<int32_t>() + r * N,
        ns.data_ptr<int32_t>() + r * N, tgt.data_ptr<int64_t>() + r * N, N, D,
        accepted.data_ptr<int32_t>() + r * D, output_tokens.data_ptr<int64_t>() + r * (D + 1));
  }
  return call.as_tuple();
}

// Copy one slot's entry ([num_kv_heads, C] at any strides) of a 4-D cache to another slot.
static void copy_slot(const at::Tensor& cache, int64_t src, int64_t dst) {
  const int64_t bs = cache.size(2), esize = cache.element_size();
  auto* base = static_cast<char*>(cache.data_ptr());
  const auto st = cache.strides();
  const int64_t H = cache.size(1), C = cache.size(3);
  auto at_slot = [&](int64_t slot) { return (slot / bs) * st[0] + (slot % bs) * st[2]; };
  const int64_t s = at_slot(src), d = at_slot(dst);
  for (int64_t h = 0; h < H; ++h) {
    if (st[3] == 1) {
      std::memcpy(base + (d + h * st[1]) * esize, base + (s + h * st[1]) * esize, C * esize);
    } else {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t off = h * st[1] + c * st[3];
        std::memcpy(base + (d + off) * esize, base + (s + off) * esize, esize);
      }
    }
  }
}

void compact_tree_cpu(at::TensorList kv_caches, const at::Tensor& hidden_states,
                      const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                      const at::Tensor& accepted, const at::Tensor& num_accepted) {
  check_compact_args(kv_caches, hidden_states, slot_mapping, query_start_loc, accepted,
                     num_accepted);
  const char* op = "compact_tree";
  const int64_t R = accepted.size(0), D = accepted.size(1);
  const auto acc = accepted.contiguous();
  const auto num = num_accepted.contiguous();
  const auto qsl = query_start_loc.to(at::kLong).contiguous();
  const auto slots = slot_mapping.contiguous();
  const int64_t* qs = qsl.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots_in_map = slots.size(0);
  const int64_t rows = hidden_states.numel() > 0 ? hidden_states.size(0) : 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = num.data_ptr<int32_t>()[r], len = qs[r + 1] - qs[r];
    DDTREE_CHECK_ARG(qs[r] >= 0 && len >= 0, op, "query_start_loc",
                     "must be non-negative and non-decreasing, got ", qs[r], " then ", qs[r + 1]);
    DDTREE_CHECK_ARG(n >= 0 && n <= D && n < std::max<int64_t>(len, 1), op, "num_accepted",
                     "request ", r, " has ", n, " accepted of ", len, " query tokens");
    for (int64_t j = 0; j < n; ++j) {
      const int64_t node = acc.data_ptr<int32_t>()[r * D + j];
      DDTREE_CHECK_ARG(node > j && node < len, op, "accepted", "request ", r, " entry ", j,
                       " is node ", node, ": must be in (", j, ", ", len, ")");
      if (node == j + 1) continue;  // already in place
      const int64_t src = qs[r] + node, dst = qs[r] + j + 1;
      DDTREE_CHECK_ARG(kv_caches.empty() || src < num_slots_in_map, op, "slot_mapping",
                       "is shorter than query_start_loc implies");
      for (const auto& cache : kv_caches) {
        const int64_t capacity = cache.size(0) * cache.size(2);
        DDTREE_CHECK_ARG(slot[src] >= 0 && slot[src] < capacity && slot[dst] >= 0 &&
                             slot[dst] < capacity,
                         op, "slot_mapping", "slot out of the cache's ", capacity, " slots");
        copy_slot(cache, slot[src], slot[dst]);
      }
      if (rows > 0) {
        DDTREE_CHECK_ARG(src < rows, op, "hidden_states", "has ", rows, " rows, needs ",
                         src + 1);
        hidden_states[dst].copy_(hidden_states[src]);
      }
    }
  }
}

TORCH_LIBRARY_IMPL(vllm_ddtree, CPU, m) {
  m.impl("tree_positions", &tree_positions_cpu);
  m.impl("build_tree", &build_tree_cpu);
  m.impl("verify_tree", &verify_tree_cpu);
  m.impl("compact_tree", &compact_tree_cpu);
}

}  // namespace vllm_ddtree
