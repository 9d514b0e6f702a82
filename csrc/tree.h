// Per-request tree build and verification walk, shared by the CPU and CUDA implementations
// (one request per call; the callers parallelize over requests). The batch-of-trees layout
// and the selection and tie rules are documented once, in vllm_ddtree/tree.py.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define DDTREE_HD __host__ __device__
#else
#define DDTREE_HD
#endif

namespace vllm_ddtree {

// The score's bits mapped to an unsigned order: a larger float, larger bits.
DDTREE_HD inline uint32_t ordered_bits(float score) {
  uint32_t bits;
  memcpy(&bits, &score, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// A candidate node: the `rank`-th token under node `parent` (at drafter position
// depths[parent]). It is one 64-bit key, so the heap compares and moves 8 bytes: the score's
// bits mapped to an unsigned order (high 32 bits), then parent and rank inverted (11 bits
// each; both are < 2048 because budget <= 1024) so that the larger key wins the tie rule:
// score descending, then parent index ascending, then rank ascending.
struct Candidate {
  uint64_t key;

  DDTREE_HD static Candidate make(float score, int32_t parent, int32_t rank) {
    return {(static_cast<uint64_t>(ordered_bits(score)) << 22) | (static_cast<uint64_t>(2047 - parent) << 11) |
                static_cast<uint64_t>(2047 - rank)};
  }
  DDTREE_HD float score() const {
    uint32_t bits = static_cast<uint32_t>(key >> 22);
    bits = (bits & 0x80000000u) ? (bits & 0x7fffffffu) : ~bits;
    float s;
    memcpy(&s, &bits, sizeof(s));
    return s;
  }
  DDTREE_HD int32_t parent() const { return 2047 - static_cast<int32_t>((key >> 11) & 2047); }
  DDTREE_HD int32_t rank() const { return 2047 - static_cast<int32_t>(key & 2047); }
};

DDTREE_HD inline bool better(const Candidate& a, const Candidate& b) { return a.key > b.key; }

// A 4-ary max-heap (by `better`) over caller-provided storage of budget + 1 entries:
// half the levels of a binary heap, so fewer dependent loads per pop.
struct CandidateHeap {
  Candidate* data;
  int32_t size = 0;

  DDTREE_HD void push(const Candidate& c) {
    int32_t i = size++;
    while (i > 0) {
      const int32_t up = (i - 1) / 4;
      if (!better(c, data[up])) break;
      data[i] = data[up];
      i = up;
    }
    data[i] = c;
  }

  // Replace the top by `c` and restore the heap. The builder pops the best candidate and
  // pushes its children: a child scores near its parent, so it sinks only a little from
  // the top, where a pop followed by a push would move two entries across the whole heap.
  DDTREE_HD void replace_top(const Candidate& c) {
    int32_t i = 0;
    while (true) {
      const int32_t first = 4 * i + 1;
      if (first >= size) break;
      int32_t best = first;
      const int32_t end = first + 4 < size ? first + 4 : size;
      for (int32_t k = first + 1; k < end; ++k) {
        if (better(data[k], data[best])) best = k;
      }
      if (!better(data[best], c)) break;
      data[i] = data[best];
      i = best;
    }
    data[i] = c;
  }

  DDTREE_HD void pop() {
    const Candidate last = data[--size];
    if (size > 0) replace_top(last);
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

// Per-depth child counts of JetSpec's build: w[min(depth, n - 1)] children per expanded node
// at drafter position `depth` (a kernel argument by value, so no device memory). n == 0: the
// best-first build.
constexpr int32_t kMaxWidths = 32;
struct Widths {
  int32_t w[kMaxWidths];
  int32_t n;
  DDTREE_HD int32_t at(int32_t depth) const { return w[depth < n ? depth : n - 1]; }
};

// Appends node n of a tree under construction: its row, and its place in its parent's
// child list (children are added in rank order, so the list is rank-ordered).
DDTREE_HD inline int32_t add_node(TreeRows& t, int32_t& n, int32_t K, float score,
                                  int32_t parent, int32_t rank, int32_t pos) {
  const int32_t i = n++;
  t.token_ids[i] = static_cast<int64_t>(pos) * K + rank;
  t.parents[i] = parent;
  t.depths[i] = pos + 1;
  t.scores[i] = score;
  t.first_child[i] = t.next_sibling[i] = t.last_child[i] = -1;
  if (t.last_child[parent] < 0) {
    t.first_child[parent] = i;
  } else {
    t.next_sibling[t.last_child[parent]] = i;
  }
  t.last_child[parent] = i;
  return i;
}

DDTREE_HD inline void add_root(TreeRows& t, int64_t root_token) {
  t.token_ids[0] = root_token;
  t.parents[0] = -1;
  t.depths[0] = 0;
  t.first_child[0] = t.next_sibling[0] = t.last_child[0] = -1;
  t.scores[0] = 0.0f;
}

// JetSpec's build (arXiv 2606.18394) of one request's tree: repeatedly take the best node
// not yet expanded, by (score descending, node index ascending), and append its children of
// ranks 0 .. w(depth) - 1, until budget nodes. With spine the rank-0 chain (nodes 1..
// min(L, budget)) is laid first; a chain node's rank-0 child is the next one. Inputs and
// outputs as build_one_tree's; the caller guarantees that the widths allow budget nodes.
DDTREE_HD inline void build_one_tree_expanding(const float* logprobs, int32_t L, int32_t K,
                                               const Widths& widths, int32_t budget,
                                               bool spine, int64_t root_token,
                                               Candidate* heap_storage, TreeRows t) {
  add_root(t, root_token);
  int32_t n = 1, chain = 0;  // nodes 0 .. chain - 1 already have their rank-0 child
  CandidateHeap heap{heap_storage};
  heap.push(Candidate::make(0.0f, 0, 0));  // a node as a candidate: (score, index, 0)
  if (spine) {
    for (int32_t pos = 0, parent = 0; pos < L && n <= budget; ++pos) {
      parent = add_node(t, n, K, t.scores[parent] + logprobs[pos * K], parent, 0, pos);
      heap.push(Candidate::make(t.scores[parent], parent, 0));
    }
    chain = n - 1;
  }
  while (n <= budget && heap.size > 0) {
    const int32_t p = heap.data[0].parent(), pos = t.depths[p];
    heap.pop();
    if (pos >= L) continue;
    const int32_t w = widths.at(pos) < K ? widths.at(pos) : K;
    for (int32_t rank = p < chain ? 1 : 0; rank < w && n <= budget; ++rank) {
      const int32_t i = add_node(t, n, K, t.scores[p] + logprobs[pos * K + rank], p, rank, pos);
      heap.push(Candidate::make(t.scores[i], i, 0));
    }
  }
}

// Build one request's tree from its top-k log-probs ([L, K] row-major). Node i > 0's
// token_ids entry is its flat top-k index (depth - 1) * K + rank, which the caller turns
// into the token id afterwards: the ids are not read in this serial loop (on CUDA each read
// would stall the one thread running it; the block resolves them in parallel). The caller
// guarantees budget <= number of prefixes the top-k allows, and heap storage of budget + 1.
DDTREE_HD inline void build_one_tree(const float* logprobs, int32_t L, int32_t K,
                                     int32_t budget, bool spine, int64_t root_token,
                                     Candidate* heap_storage, TreeRows t) {
  add_root(t, root_token);
  int32_t n = 1;
  CandidateHeap heap{heap_storage};

  auto add = [&](float score, int32_t parent, int32_t rank, int32_t pos) {
    return add_node(t, n, K, score, parent, rank, pos);
  };
  auto push_sibling = [&](int32_t parent, int32_t rank, int32_t pos) {
    if (rank + 1 < K) {
      heap.push(Candidate::make(t.scores[parent] + logprobs[pos * K + rank + 1], parent,
                                rank + 1));
    }
  };

  if (spine) {  // the rank-0 chain first; its nodes' rank-0 children are the chain itself
    int32_t parent = 0;
    for (int32_t pos = 0; pos < L && n <= budget; ++pos) {
      push_sibling(parent, 0, pos);
      parent = add(t.scores[parent] + logprobs[pos * K], parent, 0, pos);
    }
  } else {
    heap.push(Candidate::make(logprobs[0], 0, 0));
  }
  while (n <= budget && heap.size > 0) {
    const Candidate c = heap.data[0];
    const float score = c.score();
    const int32_t parent = c.parent(), rank = c.rank(), pos = t.depths[parent];
    const int32_t i = add(score, parent, rank, pos);
    if (pos + 1 < L) {  // the first child takes the popped top's place
      heap.replace_top(Candidate::make(score + logprobs[(pos + 1) * K], i, 0));
    } else {
      heap.pop();
    }
    push_sibling(parent, rank, pos);
  }
}

// One request's tree by the build `widths` names: JetSpec's (widths.n > 0) or best-first.
DDTREE_HD inline void build_tree_of(const float* logprobs, int32_t L, int32_t K,
                                    const Widths& widths, int32_t budget, bool spine,
                                    int64_t root_token, Candidate* heap_storage, TreeRows t) {
  if (widths.n > 0) {
    build_one_tree_expanding(logprobs, L, K, widths, budget, spine, root_token, heap_storage, t);
  } else {
    build_one_tree(logprobs, L, K, budget, spine, root_token, heap_storage, t);
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
