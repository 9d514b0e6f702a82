// The parallel build of one request's tree by one CUDA block (csrc/cuda/tree_ops.cu's build
// kernel calls build_parallel): block scan, enumeration above a threshold, bitonic sort, tie
// order, and the rows of both builds. The serial heap of csrc/tree.h defines the result.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "../tree.h"

namespace vllm_ddtree {

// ---- The build: one block per request. ----
//
// On rank-sorted log-probs that are at most 0 (topk_ranked's) the build runs in parallel
// within the block. A prefix then scores no more than its parent or its lower-ranked
// sibling, so the heap pops in the order of its keys: best-first's tree is the `need` best
// prefixes off the spine by the tie rule (tree.py), and JetSpec's expands nodes in (score,
// node index) order. The block finds a score threshold t above which the prefixes number
// at most a cap yet enough (bisection; each try enumerates them depth by depth: per node a
// binary search for its children above t, a block scan to place them), sorts them by
// score, orders equal scores by the tie rule (walking up the parents), and keeps the first
// need (best-first) or lets them expand in that order (JetSpec). Other inputs (unsorted,
// positive, NaN or -0.0 log-probs; more ties at the threshold than the cap) take the
// serial heap of tree.h on thread 0, which stays the definition: both give the CPU op's
// tree, bit for bit.

constexpr unsigned int kFullMask = 0xffffffffu;
constexpr int32_t kMaxThresholdTries = 64;

// Bytes per entry of the parallel build's enumeration: sort key (the scan's counts share
// it) 8, score, parent, rank, depth-and-spine flag, node index 4 each.
constexpr size_t kEnumBytesPerEntry = sizeof(uint64_t) + 5 * sizeof(int32_t);
constexpr size_t kWarpSumsBytes = 32 * sizeof(int32_t);

// Entries the enumeration holds: a power of two (the sort's) >= 2 * budget + L + 1, so the
// cap on counted prefixes, entries - L - 1, is at least twice the budget; and at least 256,
// which small trees' ties (a vocabulary of one scores every prefix 0) fit in.
inline int64_t enumeration_entries(int64_t budget, int64_t L) {
  int64_t p = 256;
  while (p < 2 * budget + L + 1) p *= 2;
  return p;
}

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32); `total` is the
// sum. Every thread calls it; warp_sums is 32 ints of shared memory.
__device__ inline int32_t block_exclusive_scan(int32_t v, int32_t* warp_sums, int32_t& total) {
  const int32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int32_t x = v;
  for (int32_t o = 1; o < 32; o *= 2) {
    const int32_t y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < warps ? warp_sums[lane] : 0;
    for (int32_t o = 1; o < 32; o *= 2) {
      const int32_t y = __shfl_up_sync(kFullMask, w, o);
      if (lane >= o) w += y;
    }
    if (lane < warps) warp_sums[lane] = w;
  }
  __syncthreads();
  total = warp_sums[warps - 1];
  const int32_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  __syncthreads();  // warp_sums is free again
  return before;
}

// In place: a[0..n) becomes its exclusive prefix sum; returns the total.
__device__ inline int32_t scan_in_place(int32_t* a, int32_t n, int32_t* warp_sums) {
  const int32_t per = (n + blockDim.x - 1) / blockDim.x;
  const int32_t mine = static_cast<int32_t>(threadIdx.x) * per;
  const int32_t begin = mine < n ? mine : n, end = begin + per < n ? begin + per : n;
  int32_t sum = 0;
  for (int32_t i = begin; i < end; ++i) sum += a[i];
  int32_t total;
  int32_t run = block_exclusive_scan(sum, warp_sums, total);
  for (int32_t i = begin; i < end; ++i) {
    const int32_t c = a[i];
    a[i] = run;
    run += c;
  }
  __syncthreads();
  return total;
}

// A node's children in the tree: all ranks (best-first) or JetSpec's w(depth), within K.
DDTREE_HD inline int32_t max_children(const Widths& widths, int32_t depth, int32_t K) {
  if (widths.n == 0) return K;
  const int32_t w = widths.at(depth);
  return w < K ? w : K;
}

// The enumeration: entry 0 is the root; the entries of depth d + 1 follow those of depth d,
// each node's children contiguous and in rank order. meta = depth << 1 | on-spine (the
// root and, with spine, the rank-0 chain to depth Lc: the tree's nodes 0..Lc).
struct Enumeration {
  uint64_t* keys;
  float* score;
  int32_t *parent, *rank, *meta, *index, *warp_sums;
  int32_t capacity;

  __device__ int32_t depth(int32_t e) const { return meta[e] >> 1; }
  __device__ bool on_spine(int32_t e) const { return meta[e] & 1; }

  // Every prefix scoring >= t (of at most max_children children a node), depth by depth;
  // returns how many are off the spine, or cap + 1 once they are more than cap. `size`
  // gets the entries used, `expandable` the children the entries above depth L can take
  // (JetSpec's build: the spine's nodes above Lc have their rank-0 child already).
  __device__ int32_t enumerate(float t, const float* lp, int32_t L, int32_t K,
                               const Widths& widths, int32_t Lc, int32_t cap, int32_t& size,
                               int32_t& expandable) {
    auto* counts = reinterpret_cast<int32_t*>(keys);
    if (threadIdx.x == 0) {
      score[0] = 0.0f;
      parent[0] = -1;
      rank[0] = 0;
      meta[0] = 1;
    }
    __syncthreads();
    int32_t begin = 0, end = 1, counted = 0;
    expandable = 0;
    for (int32_t d = 0; d < L && end > begin; ++d) {
      const int32_t n = end - begin, most = max_children(widths, d, K);
      const float* row = lp + static_cast<int64_t>(d) * K;
      for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float s = score[begin + i];
        int32_t lo = 0, hi = most;  // children above t: a rank prefix (row is sorted)
        while (lo < hi) {
          const int32_t mid = (lo + hi) / 2;
          if (s + row[mid] >= t) lo = mid + 1; else hi = mid;
        }
        counts[i] = lo;
      }
      __syncthreads();
      // A level's first entry is its spine node (by induction from the root), whose rank-0
      // child continues the spine while d < Lc.
      const bool spine_parent = on_spine(begin) && d < Lc;
      const bool spine_child = spine_parent && counts[0] > 0;
      expandable += n * most - (spine_parent ? 1 : 0);
      const int32_t total = scan_in_place(counts, n, warp_sums);
      counted += total - (spine_child ? 1 : 0);
      if (counted > cap || end + total > capacity) return cap + 1;
      for (int32_t j = threadIdx.x; j < total; j += blockDim.x) {
        int32_t lo = 0, hi = n;  // the parent: the last i with counts[i] <= j
        while (lo < hi) {
          const int32_t mid = (lo + hi) / 2;
          if (counts[mid] <= j) lo = mid + 1; else hi = mid;
        }
        const int32_t p = begin + lo - 1, r = j - counts[lo - 1], e = end + j;
        score[e] = score[p] + row[r];
        parent[e] = p;
        rank[e] = r;
        meta[e] = (d + 1) << 1 | (j == 0 && spine_child ? 1 : 0);
      }
      __syncthreads();
      begin = end;
      end += total;
    }
    size = end;
    return counted;
  }

  // Whether entry a comes before entry b (a != b) in the order of the tree's nodes, a node
  // index's: score, then the parents' order, then rank. Best-first numbers the spine first
  // (by depth), then nodes in this order, so a parent's order is the spine's before it
  // compares scores. JetSpec (expanding) numbers a node's children when it expands, in
  // (score, node index) order, so its spine (node index = depth) comes first only among
  // equal scores, at every level. (No score is -0.0 or NaN: floats compare as the heap's
  // bits do.)
  __device__ bool before(int32_t a, int32_t b, bool expanding) const {
    auto spine_first = [&](int32_t x, int32_t y) {
      return on_spine(x) && on_spine(y) ? depth(x) < depth(y) : on_spine(x);
    };
    while (true) {
      if (score[a] != score[b]) return score[a] > score[b];
      if (expanding && (on_spine(a) || on_spine(b))) return spine_first(a, b);
      const int32_t pa = parent[a], pb = parent[b];
      if (pa == pb) return rank[a] < rank[b];
      if (!expanding && (on_spine(pa) || on_spine(pb))) return spine_first(pa, pb);
      a = pa;
      b = pb;
    }
  }
};

__device__ inline int32_t lower_bound(const uint64_t* keys, int32_t n, uint64_t key) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Ascending bitonic sort of keys[0..n), n a power of two.
__device__ inline void bitonic_sort(uint64_t* keys, int32_t n) {
  for (int32_t k = 2; k <= n; k *= 2) {
    for (int32_t j = k / 2; j > 0; j /= 2) {
      for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int32_t l = i ^ j;
        if (l > i) {
          const uint64_t a = keys[i], b = keys[l];
          if (((i & k) == 0) == (a > b)) {
            keys[i] = b;
            keys[l] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Whether the log-probs suit the parallel build: each depth's sorted, none above 0, no
// NaN, and no -0.0 (the serial build gives the root's first child the log-prob itself but
// others 0 + it, so -0.0 and +0.0, which the heap's order tells apart and a float's not).
__device__ inline bool parallel_build_applies(const float* lp, int32_t L, int32_t K) {
  int32_t bad = 0;
  for (int64_t k = threadIdx.x; k < static_cast<int64_t>(L) * K; k += blockDim.x) {
    bad |= k % K == 0 ? !(lp[k] <= 0.0f) : !(lp[k - 1] >= lp[k]);  // NaN is bad too
    bad |= ordered_bits(lp[k]) == 0x7fffffffu;
  }
  return __syncthreads_count(bad) == 0;
}

// Each entry's place in the order of `before` (en.index), among the entries off the spine
// (best-first: the spine is laid first) or all of them (JetSpec: the spine expands in
// turn): a bitonic sort by score, then, within equal scores, a count of those before.
// `placed`: how many entries that is (size, or those off the spine).
__device__ void place_entries(Enumeration en, int32_t size, bool expanding, int32_t placed) {
  int32_t n = 1;
  while (n < size) n *= 2;
  for (int32_t e = threadIdx.x; e < n; e += blockDim.x) {
    const bool ranked = e < size && (expanding || !en.on_spine(e));
    en.keys[e] = ranked ? static_cast<uint64_t>(~ordered_bits(en.score[e])) << 32 | e : ~0ull;
  }
  __syncthreads();
  bitonic_sort(en.keys, n);
  for (int32_t q = threadIdx.x; q < placed; q += blockDim.x) {
    const uint64_t key = en.keys[q];
    const int32_t e = static_cast<int32_t>(key & 0xffffffffu);
    const uint64_t high = key >> 32 << 32;  // NaN scores are refused: high + 2^32 is no wrap
    const int32_t first = lower_bound(en.keys, placed, high);
    const int32_t end = lower_bound(en.keys, placed, high + (1ull << 32));
    int32_t place = first;
    for (int32_t q2 = first; end - first > 1 && q2 < end; ++q2) {
      const int32_t e2 = static_cast<int32_t>(en.keys[q2] & 0xffffffffu);
      if (e2 != e && en.before(e2, e, expanding)) ++place;
    }
    en.index[e] = place;
  }
  __syncthreads();
}

// Rows of the spine (nodes 1..Lc; the root's by add_root), each a rank-0 child.
__device__ inline void write_spine(const float* lp, int32_t K, int32_t Lc, TreeRows t) {
  float s = 0.0f;
  for (int32_t d = 1; d <= Lc; ++d) {
    s = s + lp[static_cast<int64_t>(d - 1) * K];
    t.token_ids[d] = static_cast<int64_t>(d - 1) * K;
    t.parents[d] = d - 1;
    t.depths[d] = d;
    t.scores[d] = s;
    t.first_child[d - 1] = d;
  }
}

// The parallel build of one request into the shared-memory rows: best-first, or JetSpec's
// (widths); false (having written no row) when the serial build must run instead. Every
// thread calls it.
__device__ bool build_parallel(const float* lp, int32_t L, int32_t K, const Widths& widths,
                               int32_t budget, bool spine, int64_t root_token,
                               Enumeration en, TreeRows t) {
  if (!parallel_build_applies(lp, L, K)) return false;
  const bool expanding = widths.n > 0;
  const int32_t Lc = spine ? (L < budget ? L : budget) : 0, need = budget - Lc;
  const int32_t cap = en.capacity - L - 1;
  // Bounds: every prefix scores <= 0 < hi; at lo enough do: best-first, need off the spine
  // at depth 1 where K allows; else every node down to the first depth whose nodes and
  // those above them take (JetSpec) or are (best-first) enough children, the lowest of
  // which scores the sum of each depth's last log-prob, added as the builder adds.
  float lo = 0.0f;
  if (need == 0) {
    lo = INFINITY;  // the spine alone: no prefix
  } else if (!expanding && need + (spine ? 1 : 0) <= K) {
    lo = lp[need + (spine ? 1 : 0) - 1];
  } else {
    // JetSpec counts the children of the nodes at lo; best-first, those nodes themselves.
    int64_t nodes = 1, children = 0;  // at depth d; below depths <= d
    for (int32_t d = 0; d < L; ++d) {
      const int32_t most = max_children(widths, d, K);
      children += nodes * most - (d < Lc ? 1 : 0);
      if (expanding && children >= need) break;
      lo = lo + lp[static_cast<int64_t>(d) * K + most - 1];
      if (!expanding && children >= need) break;
      nodes = nodes * most < cap ? nodes * most : cap;
    }
  }
  lo = fmaxf(lo, -FLT_MAX);
  float hi = FLT_MIN, th = lo;
  int32_t size = 0, counted = -1, expandable = 0;
  for (int32_t tries = 0;; ++tries) {
    counted = en.enumerate(th, lp, L, K, widths, Lc, cap, size, expandable);
    // Enough: best-first, need prefixes off the spine; JetSpec, nodes whose children
    // number need (the nodes expand in the tie rule's order, all above t before any below).
    const int32_t enough = expanding ? expandable : counted;
    if (counted <= cap && enough >= need) break;
    if (counted > cap) lo = th; else hi = th;
    th = lo + (hi - lo) * 0.5f;
    // No float between the bounds: more prefixes tie at one score than the cap holds.
    if (!(th > lo && th < hi) || tries == kMaxThresholdTries) return false;
  }
  const int32_t placed = expanding ? size : counted;
  place_entries(en, size, expanding, placed);
  const int32_t N = budget + 1;
  for (int32_t i = threadIdx.x; i < N; i += blockDim.x) t.first_child[i] = t.next_sibling[i] = -1;
  if (threadIdx.x == 0) add_root(t, root_token);
  __syncthreads();
  if (threadIdx.x == 0) write_spine(lp, K, Lc, t);
  if (!expanding) {
    // The first need entries off the spine are the tree's nodes Lc + 1 .. budget.
    for (int32_t e = threadIdx.x; e < size; e += blockDim.x) {
      const int32_t place = en.index[e];
      en.index[e] = en.on_spine(e) ? en.depth(e) : place < need ? Lc + 1 + place : -1;
    }
    __syncthreads();
    for (int32_t e = 1 + threadIdx.x; e < size; e += blockDim.x) {
      const int32_t i = en.index[e];
      if (i < 0) continue;
      const int32_t p = en.parent[e];
      if (e + 1 < size && en.parent[e + 1] == p && en.index[e + 1] >= 0) {
        t.next_sibling[i] = en.index[e + 1];
      }
      if (en.on_spine(e)) continue;  // its row is write_spine's
      t.token_ids[i] = static_cast<int64_t>(en.depth(e) - 1) * K + en.rank[e];
      t.parents[i] = en.index[p];
      t.depths[i] = en.depth(e);
      t.scores[i] = en.score[e];
      if (en.rank[e] == 0) t.first_child[en.index[p]] = i;
    }
    __syncthreads();
    return true;
  }
  // JetSpec: the entries expand in place order, each appending its children of ranks
  // first .. max_children - 1 (first: 1 on the spine above Lc, else 0) as the next nodes,
  // until need. order[place] = entry, then `appended` = the children before each place.
  auto* order = reinterpret_cast<int32_t*>(en.keys);
  int32_t* appended = order + placed;
  for (int32_t e = threadIdx.x; e < size; e += blockDim.x) order[en.index[e]] = e;
  __syncthreads();
  auto first_rank = [&](int32_t e) { return en.on_spine(e) && en.depth(e) < Lc ? 1 : 0; };
  for (int32_t q = threadIdx.x; q < placed; q += blockDim.x) {
    const int32_t e = order[q], d = en.depth(e);
    appended[q] = d < L ? max_children(widths, d, K) - first_rank(e) : 0;
  }
  __syncthreads();
  scan_in_place(appended, placed, en.warp_sums);
  // Each entry's node index: its place among its parent's appended children.
  for (int32_t q = threadIdx.x; q < placed; q += blockDim.x) {
    const int32_t e = order[q];
    if (en.on_spine(e)) {
      en.rank[e] = en.depth(e);  // rank is free now: it holds the node index
      continue;
    }
    const int32_t p = en.parent[e], j = appended[en.index[p]] + en.rank[e] - first_rank(p);
    en.rank[e] = j < need ? Lc + 1 + j : -1;
  }
  __syncthreads();
  for (int32_t q = threadIdx.x; q < placed; q += blockDim.x) {
    const int32_t e = order[q], d = en.depth(e), start = appended[q];
    const int32_t i = en.rank[e], first = first_rank(e);
    if (d >= L || start >= need || i < 0) continue;
    const int32_t count = max_children(widths, d, K) - first;
    const int32_t n = count < need - start ? count : need - start;
    for (int32_t j = 0; j < n; ++j) {
      const int32_t c = Lc + 1 + start + j, r = first + j;
      t.token_ids[c] = static_cast<int64_t>(d) * K + r;
      t.parents[c] = i;
      t.depths[c] = d + 1;
      t.scores[c] = en.score[e] + lp[static_cast<int64_t>(d) * K + r];
      if (j + 1 < n) t.next_sibling[c] = c + 1;
    }
    if (n > 0) {
      if (first == 0) {
        t.first_child[i] = Lc + 1 + start;
      } else {
        t.next_sibling[i + 1] = Lc + 1 + start;  // after the spine's own rank-0 child
      }
    }
  }
  __syncthreads();
  return true;
}

}  // namespace vllm_ddtree
