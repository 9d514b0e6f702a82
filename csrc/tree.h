// Per-request tree build and verification walk, shared by the CPU and CUDA implementations
// (one request per call; the callers parallelize over requests). The batch-of-trees layout
// and the selection and tie rules are documented once, in vllm_ddtree/tree.py.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define DDTREE_HD __host__ __device__
#else
#define DDTREE_HD
#endif

namespace vllm_ddtree {

// A candidate node: the `rank`-th token at drafter position `pos` under node `parent`.
struct Candidate {
  float score;
  int32_t parent;
  int32_t rank;
  int32_t pos;
};

// The tie rule: score descending, then parent index ascending, then rank ascending.
DDTREE_HD inline bool better(const Candidate& a, const Candidate& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.parent != b.parent) return a.parent < b.parent;
  return a.rank < b.rank;
}

// A binary max-heap (by `better`) over caller-provided storage of budget + 1 entries.
struct CandidateHeap {
  Candidate* data;
  int32_t size = 0;

  DDTREE_HD void push(const Candidate& c) {
    int32_t i = size++;
    while (i > 0) {
      const int32_t up = (i - 1) / 2;
      if (!better(c, data[up])) break;
      data[i] = data[up];
      i = up;
    }
    data[i] = c;
  }

  DDTREE_HD Candidate pop() {
    const Candidate top = data[0];
    const Candidate last = data[--size];
    int32_t i = 0;
    while (true) {
      int32_t child = 2 * i + 1;
      if (child >= size) break;
      if (child + 1 < size && better(data[child + 1], data[child])) ++child;
      if (!better(data[child], last)) break;
      data[i] = data[child];
      i = child;
    }
    if (size > 0) data[i] = last;
    return top;
  }
};

// Output rows of one request's tree (each of budget + 1 entries; see tree.py).
struct TreeRows {
  int64_t* token_ids;
  int32_t* parents;
  int32_t* depths;
  int32_t* first_child;
  int32_t* next_sibling;
  float* scores;
  int32_t* last_child;  // scratch: the most recent child of each node
};

// Build one request's tree from its top-k log-probs and ids ([L, K] row-major). The caller
// guarantees budget <= number of prefixes the top-k allows, and heap storage of budget + 1.
DDTREE_HD inline void build_one_tree(const float* logprobs, const int64_t* ids, int32_t L,
                                     int32_t K, int32_t budget, bool spine, int64_t root_token,
                                     Candidate* heap_storage, TreeRows t) {
  t.token_ids[0] = root_token;
  t.parents[0] = -1;
  t.depths[0] = 0;
  t.first_child[0] = t.next_sibling[0] = t.last_child[0] = -1;
  t.scores[0] = 0.0f;
  int32_t n = 1;
  CandidateHeap heap{heap_storage};

  auto add = [&](const Candidate& c) {
    const int32_t i = n++;
    t.token_ids[i] = ids[c.pos * K + c.rank];
    t.parents[i] = c.parent;
    t.depths[i] = c.pos + 1;
    t.scores[i] = c.score;
    t.first_child[i] = t.next_sibling[i] = t.last_child[i] = -1;
    if (t.last_child[c.parent] < 0) {
      t.first_child[c.parent] = i;
    } else {
      t.next_sibling[t.last_child[c.parent]] = i;
    }
    t.last_child[c.parent] = i;
    return i;
  };
  auto push_sibling = [&](const Candidate& c) {
    if (c.rank + 1 < K) {
      heap.push({t.scores[c.parent] + logprobs[c.pos * K + c.rank + 1], c.parent, c.rank + 1,
                 c.pos});
    }
  };

  if (spine) {  // the rank-0 chain first; its nodes' rank-0 children are the chain itself
    int32_t parent = 0;
    for (int32_t pos = 0; pos < L && n <= budget; ++pos) {
      const Candidate c{t.scores[parent] + logprobs[pos * K], parent, 0, pos};
      push_sibling(c);
      parent = add(c);
    }
  } else {
    heap.push({logprobs[0], 0, 0, 0});
  }
  while (n <= budget && heap.size > 0) {
    const Candidate c = heap.pop();
    const int32_t i = add(c);
    push_sibling(c);
    if (c.pos + 1 < L) heap.push({c.score + logprobs[(c.pos + 1) * K], i, 0, c.pos + 1});
  }
}

// Walk one request's tree: from the root, follow the child whose token is the target's
// choice at the current node; the first miss yields the bonus token. Out-of-range links are
// treated as absent, so malformed input cannot read out of bounds.
DDTREE_HD inline int32_t verify_one_tree(const int64_t* token_ids, const int32_t* first_child,
                                         const int32_t* next_sibling,
                                         const int64_t* target_tokens, int32_t num_nodes,
                                         int32_t max_depth, int32_t* accepted,
                                         int64_t* output_tokens) {
  int32_t cur = 0, n = 0;
  while (n < max_depth) {
    const int64_t want = target_tokens[cur];
    int32_t c = first_child[cur];
    for (int32_t hops = 0; c > 0 && c < num_nodes && hops < num_nodes; ++hops) {
      if (token_ids[c] == want) break;
      c = next_sibling[c];
    }
    if (c <= 0 || c >= num_nodes || token_ids[c] != want) break;
    accepted[n] = c;
    output_tokens[n] = want;
    ++n;
    cur = c;
  }
  output_tokens[n] = target_tokens[cur];
  for (int32_t j = n; j < max_depth; ++j) {
    accepted[j] = -1;
    output_tokens[j + 1] = -1;
  }
  return n;
}

}  // namespace vllm_ddtree
