// CUDA implementations of the vllm_ddtree ops. Same signatures and results as csrc/cpu/;
// none synchronizes with the host or allocates a data-dependent shape, so each can run
// inside a captured CUDA graph. Bad values inside tensors are guarded, never dereferenced.
#include <ATen/ATen.h>
#include <torch/library.h>

// tests/cuda_emulator runs this file on CPU threads: it defines the runtime calls and these
// two spellings (a launch, a block's dynamic shared memory) before including it.
#ifndef DDTREE_CUDA_EMULATOR
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define DDTREE_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define DDTREE_DYNAMIC_SMEM(name) extern __shared__ __align__(8) unsigned char name[]
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../tree.h"
#include "../tree_checks.h"
#include "../tree_outputs.h"
#include "parallel_build.cuh"

namespace vllm_ddtree {
namespace {

constexpr int kThreads = 128;
// Dynamic shared memory a kernel gets without opting in (cudaFuncSetAttribute).
constexpr size_t kDefaultSmemBytes = 48 * 1024;

__global__ void tree_positions_kernel(const int64_t* __restrict__ seq_lens,
                                      const int64_t* __restrict__ depths,
                                      int64_t* __restrict__ positions, int64_t num_nodes,
                                      int64_t total) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx < total) positions[idx] = seq_lens[idx / num_nodes] + depths[idx];
}

// Bytes per node of the tree's rows in shared memory: token (flat top-k index) 8, score,
// parent, depth, first child, next sibling, last child (serial build's scratch) 4 each.
constexpr size_t kRowBytesPerNode = sizeof(int64_t) + 6 * sizeof(int32_t);

#ifndef DDTREE_BUILD_MAX_THREADS
#define DDTREE_BUILD_MAX_THREADS 1024
#endif
#ifndef DDTREE_COUNT_BUILD  // the emulator counts which build each request took
#define DDTREE_COUNT_BUILD(parallel)
#endif

// Shared memory of one request's build: the tree's rows (read back at every step of the
// serial build: in shared memory these dependent reads take tens of cycles, where global
// memory's go through L2), then the work area (the parallel build's enumeration, or the
// serial build's heap), then, where it fits, the request's top-k log-probs.
struct BuildLayout {
  size_t rows, work, total_without_logprobs;
  int64_t entries;
  bool parallel;
};

inline BuildLayout build_layout(int64_t budget, int64_t L, size_t optin) {
  const int64_t N = budget + 1;
  BuildLayout b{};
  b.rows = N * kRowBytesPerNode;
  const size_t heap = N * sizeof(Candidate);
  b.entries = enumeration_entries(budget, L);
  const size_t enumeration = b.entries * kEnumBytesPerEntry + kWarpSumsBytes;
  b.parallel = b.rows + enumeration <= optin;
  b.work = b.parallel ? std::max(heap, enumeration) : heap;
  b.total_without_logprobs = b.rows + b.work;
  return b;
}

// The block stages the log-probs (if stage_logprobs), builds the tree's rows in shared
// memory (in parallel, or on thread 0), then every thread copies rows out, looks its nodes'
// token ids up, and fills their ancestor masks by walking their parent chains (depth <= L).
__global__ void build_tree_kernel(const int64_t* __restrict__ roots,
                                  const float* __restrict__ logprobs,
                                  const int64_t* __restrict__ ids, int32_t L, int32_t K,
                                  Widths widths, int32_t budget, bool spine,
                                  bool stage_logprobs, bool parallel, int32_t entries,
                                  int32_t work_bytes,
                                  int64_t* token_ids, int32_t* parents, int32_t* depths,
                                  int32_t* first_child, int32_t* next_sibling, int32_t* mask,
                                  float* scores) {
  DDTREE_DYNAMIC_SMEM(smem);
  const int32_t N = budget + 1, W = (N + 31) / 32;
  const int64_t r = blockIdx.x, LK = static_cast<int64_t>(L) * K;
  auto* s_tokens = reinterpret_cast<int64_t*>(smem);
  auto* s_scores = reinterpret_cast<float*>(s_tokens + N);
  auto* s_parents = reinterpret_cast<int32_t*>(s_scores + N);
  int32_t* s_depths = s_parents + N;
  int32_t* s_first = s_depths + N;
  int32_t* s_next = s_first + N;
  int32_t* s_last = s_next + N;
  unsigned char* work = smem + N * kRowBytesPerNode;  // 8-aligned: 32 bytes a node
  const float* lp = logprobs + r * LK;
  if (stage_logprobs) {
    auto* s_logprobs = reinterpret_cast<float*>(work + work_bytes);
    for (int64_t k = threadIdx.x; k < LK; k += blockDim.x) s_logprobs[k] = lp[k];
    __syncthreads();
    lp = s_logprobs;
  }
  TreeRows rows{s_tokens, s_parents, s_depths, s_first, s_next, s_scores, s_last};
  bool built = false;
  if (parallel) {
    auto* keys = reinterpret_cast<uint64_t*>(work);
    auto* score = reinterpret_cast<float*>(keys + entries);
    auto* ints = reinterpret_cast<int32_t*>(score + entries);
    const Enumeration en{keys, score, ints, ints + entries, ints + 2 * entries,
                         ints + 3 * entries, ints + 4 * entries, entries};
    built = build_parallel(lp, L, K, widths, budget, spine, roots[r], en, rows);
  }
  if (threadIdx.x == 0) DDTREE_COUNT_BUILD(built);
  if (!built && threadIdx.x == 0) {
    build_tree_of(lp, L, K, widths, budget, spine, roots[r],
                  reinterpret_cast<Candidate*>(work), rows);
  }
  __syncthreads();
  for (int32_t i = threadIdx.x; i < N; i += blockDim.x) {
    const int64_t o = r * N + i;
    // Past the root, build_one_tree left each node's flat top-k index: its id is looked up.
    token_ids[o] = i == 0 ? s_tokens[0] : ids[r * LK + s_tokens[i]];
    parents[o] = s_parents[i];
    depths[o] = s_depths[i];
    first_child[o] = s_first[i];
    next_sibling[o] = s_next[i];
    scores[o] = s_scores[i];
    int32_t* m = mask + o * W;
    for (int32_t w = 0; w < W; ++w) m[w] = 0;
    for (int32_t j = i, hops = 0; j >= 0 && j < N && hops <= N; j = s_parents[j], ++hops) {
      m[j / 32] |= static_cast<int32_t>(1u << (j % 32));
    }
  }
}

// One block per request: the block stages the request's tree and the target's choices in
// shared memory (coalesced), then thread 0 walks them. Each hop of the walk is a dependent
// read (a wide tree's sibling list can be hundreds long): tens of cycles in shared memory,
// hundreds in global memory, which a tree too large to stage is read from.
constexpr size_t kVerifyBytesPerNode = 2 * sizeof(int64_t) + 2 * sizeof(int32_t);

__global__ void verify_tree_kernel(const int64_t* token_ids, const int32_t* first_child,
                                   const int32_t* next_sibling, const int64_t* target_tokens,
                                   int32_t N, int32_t D, bool stage, int32_t* accepted,
                                   int32_t* num_accepted, int64_t* output_tokens) {
  DDTREE_DYNAMIC_SMEM(smem);
  const int64_t r = blockIdx.x, base = r * N;
  const int64_t* tokens = token_ids + base;
  const int64_t* targets = target_tokens + base;
  const int32_t* first = first_child + base;
  const int32_t* next = next_sibling + base;
  if (stage) {
    auto* s_tokens = reinterpret_cast<int64_t*>(smem);
    int64_t* s_targets = s_tokens + N;
    auto* s_first = reinterpret_cast<int32_t*>(s_targets + N);
    int32_t* s_next = s_first + N;
    for (int32_t i = threadIdx.x; i < N; i += blockDim.x) {
      s_tokens[i] = tokens[i];
      s_targets[i] = targets[i];
      s_first[i] = first[i];
      s_next[i] = next[i];
    }
    __syncthreads();
    tokens = s_tokens;
    targets = s_targets;
    first = s_first;
    next = s_next;
  }
  if (threadIdx.x == 0) {
    num_accepted[r] = verify_one_tree(tokens, first, next, targets, N, D, accepted + r * D,
                                      output_tokens + r * (D + 1));
  }
}

// Geometry of one cache (4-D [num_blocks, heads, block_size, C], any strides) or, with
// block_size 1 and heads 1, of a hidden-state matrix addressed by row.
struct Entries {
  int64_t block_size, s_block, s_head, s_offset, s_c, heads, c, capacity;
};

// Base pointers of the caches one launch compacts (all of one geometry), passed by value
// as a kernel argument: no host-to-device copy, so a launch can be captured in a CUDA graph.
constexpr int kMaxCachesPerLaunch = 64;
struct CacheBases {
  void* data[kMaxCachesPerLaunch];
};

// One block per (request, cache); accepted nodes move in path order (a later source is
// never an earlier destination), one entry at a time across the block's threads.
template <typename word_t>
__global__ void compact_kernel(CacheBases bases, Entries e, const int64_t* slot_mapping,
                               int64_t num_slots, const int64_t* query_start,
                               const int32_t* accepted, const int32_t* num_accepted,
                               int32_t D) {
  auto* data = static_cast<word_t*>(bases.data[blockIdx.y]);
  const int64_t r = blockIdx.x;
  const int64_t start = query_start[r], len = query_start[r + 1] - start;
  if (start < 0) return;  // malformed (the whole block returns: no barrier is split)
  const int32_t n = num_accepted[r];
  for (int32_t j = 0; j < n && j < D && j + 1 < len; ++j) {
    const int64_t node = accepted[r * D + j];
    if (node <= j + 1 || node >= len) continue;  // in place already, or malformed
    int64_t src = start + node, dst = start + j + 1;
    if (slot_mapping != nullptr) {
      if (src >= num_slots) continue;
      src = slot_mapping[src];
      dst = slot_mapping[dst];
    }
    if (src < 0 || dst < 0 || src >= e.capacity || dst >= e.capacity) continue;
    const int64_t s = (src / e.block_size) * e.s_block + (src % e.block_size) * e.s_offset;
    const int64_t d = (dst / e.block_size) * e.s_block + (dst % e.block_size) * e.s_offset;
    for (int64_t k = threadIdx.x; k < e.heads * e.c; k += blockDim.x) {
      const int64_t off = (k / e.c) * e.s_head + (k % e.c) * e.s_c;
      data[d + off] = data[s + off];
    }
    __syncthreads();
  }
}

// Compacts caches[0..count) (at most kMaxCachesPerLaunch, all of geometry e and the
// element size of caches[0]) in one launch.
void launch_compact(const at::Tensor* const* caches, int count, const Entries& e,
                    const int64_t* slots, int64_t num_slots, const at::Tensor& qs,
                    const at::Tensor& acc, const at::Tensor& num, cudaStream_t stream) {
  const int64_t R = acc.size(0);
  if (R == 0 || count == 0 || e.heads * e.c == 0) return;
  CacheBases bases{};
  for (int i = 0; i < count; ++i) bases.data[i] = caches[i]->data_ptr();
  auto go = [&](auto* word) {
    using word_t = std::remove_pointer_t<decltype(word)>;
    DDTREE_LAUNCH(compact_kernel<word_t>, dim3(R, count), 256, 0, stream)(
        bases, e, slots, num_slots, qs.data_ptr<int64_t>(), acc.data_ptr<int32_t>(),
        num.data_ptr<int32_t>(), static_cast<int32_t>(acc.size(1)));
  };
  switch (caches[0]->element_size()) {  // bit copies: the type does not matter, its width does
    case 1: go(static_cast<uint8_t*>(nullptr)); break;
    case 2: go(static_cast<uint16_t*>(nullptr)); break;
    case 4: go(static_cast<uint32_t*>(nullptr)); break;
    case 8: go(static_cast<uint64_t*>(nullptr)); break;
    default: TORCH_CHECK(false, "compact_tree: unsupported element size ",
                         caches[0]->element_size());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.element_size() == b.element_size();
}

}  // namespace

at::Tensor tree_positions_cuda(const at::Tensor& seq_lens, const at::Tensor& depths) {
  check_tree_positions_args(seq_lens, depths);
  const c10::cuda::CUDAGuard guard(seq_lens.device());
  const auto lens = seq_lens.contiguous();
  const auto deps = depths.to(at::kLong).contiguous();
  auto positions = at::empty(deps.sizes(), lens.options());
  const int64_t total = deps.numel();
  if (total == 0) return positions;
  const auto blocks = static_cast<unsigned int>((total + kThreads - 1) / kThreads);
  DDTREE_LAUNCH(tree_positions_kernel, blocks, kThreads, 0,
                c10::cuda::getCurrentCUDAStream())(
      lens.data_ptr<int64_t>(), deps.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
      deps.size(1), total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return positions;
}

TreeTensors build_tree_cuda(const at::Tensor& root_tokens, const at::Tensor& topk_logprobs,
                const at::Tensor& topk_ids, int64_t budget, bool spine,
                at::IntArrayRef width_list) {
  const BuildCall call(root_tokens, topk_logprobs, topk_ids, budget, width_list);
  const int64_t R = call.R, L = call.L, K = call.K;
  const Widths& widths = call.widths;
  const at::Tensor &lp = call.logprobs, &ids = call.ids, &roots = call.roots;
  const TreeOutputs& out = call.out;
  const c10::cuda::CUDAGuard guard(topk_logprobs.device());
  if (R > 0) {
    // Stage the log-probs where they fit the block's shared memory (opting in past the
    // default 48 KiB, as at B = 1024 and L = 16: 160 KiB of tree and work, 64 KiB of
    // log-probs).
    int optin = 0;  // a device attribute: no sync, and allowed while a graph is captured
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                          topk_logprobs.get_device()));
    const BuildLayout layout = build_layout(budget, L, optin);
    const size_t staged_bytes = L * K * sizeof(float);
    const bool stage = layout.total_without_logprobs + staged_bytes <= static_cast<size_t>(optin);
    const size_t smem = layout.total_without_logprobs + (stage ? staged_bytes : 0);
    if (smem > kDefaultSmemBytes) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(
          build_tree_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    // The parallel build's sort takes entries / 2 pairs a step; the serial one uses thread 0.
    const int threads = layout.parallel
        ? static_cast<int>(std::min<int64_t>(std::max<int64_t>(layout.entries / 2, 128),
                                             DDTREE_BUILD_MAX_THREADS))
        : kThreads;
    DDTREE_LAUNCH(build_tree_kernel, R, threads, smem, c10::cuda::getCurrentCUDAStream())(
        roots.data_ptr<int64_t>(), lp.data_ptr<float>(), ids.data_ptr<int64_t>(), L, K,
        widths, budget, spine, stage, layout.parallel, static_cast<int32_t>(layout.entries),
        static_cast<int32_t>(layout.work), out.token_ids.data_ptr<int64_t>(),
        out.parents.data_ptr<int32_t>(), out.depths.data_ptr<int32_t>(),
        out.first_child.data_ptr<int32_t>(), out.next_sibling.data_ptr<int32_t>(),
        out.mask.data_ptr<int32_t>(), out.scores.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out.as_tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cuda(
    const at::Tensor& token_ids, const at::Tensor& first_child, const at::Tensor& next_sibling,
    const at::Tensor& target_tokens, int64_t max_depth) {
  const VerifyCall call(token_ids, first_child, next_sibling, target_tokens, max_depth);
  const int64_t R = call.R, N = call.N, D = call.D;
  const at::Tensor &tok = call.tok, &fc = call.fc, &ns = call.ns, &tgt = call.tgt;
  const at::Tensor &accepted = call.accepted, &num_accepted = call.num_accepted;
  const at::Tensor& output_tokens = call.output_tokens;
  const c10::cuda::CUDAGuard guard(token_ids.device());
  if (R > 0) {
    const bool stage = N * kVerifyBytesPerNode <= kDefaultSmemBytes;  // up to 2048 nodes
    DDTREE_LAUNCH(verify_tree_kernel, R, kThreads, stage ? N * kVerifyBytesPerNode : 0,
                  c10::cuda::getCurrentCUDAStream())(
        tok.data_ptr<int64_t>(), fc.data_ptr<int32_t>(), ns.data_ptr<int32_t>(),
        tgt.data_ptr<int64_t>(), N, D, stage, accepted.data_ptr<int32_t>(),
        num_accepted.data_ptr<int32_t>(), output_tokens.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return call.as_tuple();
}

void compact_tree_cuda(at::TensorList kv_caches, const at::Tensor& hidden_states,
                       const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                       const at::Tensor& accepted, const at::Tensor& num_accepted) {
  check_compact_args(kv_caches, hidden_states, slot_mapping, query_start_loc, accepted,
                     num_accepted);
  const c10::cuda::CUDAGuard guard(accepted.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto qs = query_start_loc.to(at::kLong).contiguous();
  const auto acc = accepted.contiguous(), num = num_accepted.contiguous();
  const auto slots = slot_mapping.contiguous();
  // All or nothing: element sizes the copy kernel lacks are refused before the first launch.
  const auto copyable = [](const at::Tensor& t) {
    const auto size = t.element_size();
    return size == 1 || size == 2 || size == 4 || size == 8;
  };
  for (const auto& t : kv_caches) {
    TORCH_CHECK(copyable(t), "compact_tree: argument 'kv_caches' has an unsupported element "
                "size ", t.element_size());
  }
  TORCH_CHECK(hidden_states.numel() == 0 || copyable(hidden_states), "compact_tree: argument "
              "'hidden_states' has an unsupported element size ", hidden_states.element_size());
  // Distinct caches, grouped by geometry: one launch per group (per layer, launches would
  // cost a few µs each, for every layer, every step). A layer sharing another's cache
  // (cross-layer KV sharing) lists the same tensor twice: it is compacted once, since a
  // second pass would move moved entries again (the CPU op copies all caches per path
  // step, where a repeat is harmless).
  std::vector<std::vector<const at::Tensor*>> groups;
  for (const auto& cache : kv_caches) {
    bool placed = false;
    for (auto& group : groups) {
      if (!same_geometry(*group[0], cache)) continue;
      const bool repeat = std::any_of(group.begin(), group.end(), [&](const at::Tensor* t) {
        return t->data_ptr() == cache.data_ptr();  // same geometry and address: same bytes
      });
      if (!repeat) group.push_back(&cache);
      placed = true;
      break;
    }
    if (!placed) groups.push_back({&cache});
  }
  for (const auto& group : groups) {
    const at::Tensor& c = *group[0];
    const Entries e{c.size(2), c.stride(0), c.stride(1), c.stride(2), c.stride(3), c.size(1),
                    c.size(3), c.size(0) * c.size(2)};
    for (size_t i = 0; i < group.size(); i += kMaxCachesPerLaunch) {
      const int count = static_cast<int>(
          std::min<size_t>(kMaxCachesPerLaunch, group.size() - i));
      launch_compact(group.data() + i, count, e, slots.data_ptr<int64_t>(), slots.size(0),
                     qs, acc, num, stream);
    }
  }
  if (hidden_states.numel() > 0) {
    const Entries e{1, hidden_states.stride(0), 0, 0, hidden_states.stride(1), 1,
                    hidden_states.size(1), hidden_states.size(0)};
    const at::Tensor* hidden[] = {&hidden_states};
    launch_compact(hidden, 1, e, nullptr, 0, qs, acc, num, stream);
  }
}

#ifndef DDTREE_CUDA_EMULATOR
TORCH_LIBRARY_IMPL(vllm_ddtree, CUDA, m) {
  m.impl("tree_positions", &tree_positions_cuda);
  m.impl("build_tree", &build_tree_cuda);
  m.impl("verify_tree", &verify_tree_cuda);
  m.impl("compact_tree", &compact_tree_cuda);
}
#endif

}  // namespace vllm_ddtree
