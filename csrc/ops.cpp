// The vllm_ddtree operator library: schemas here, one implementation per device in cpu/ and
// cuda/, fake (meta) implementations in vllm_ddtree/ops.py. Tree layout: vllm_ddtree/tree.py.
#include <Python.h>
#include <torch/library.h>

// Importing vllm_ddtree._C loads this library and so registers the ops below.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(vllm_ddtree, m) {
  // positions[r, i] = seq_lens[r] + depths[r, i]: tree nodes sit at context + depth, so
  // siblings share a position (RoPE of a branch, not of the flattened order).
  m.def("tree_positions(Tensor seq_lens, Tensor depths) -> Tensor");
  // A batch of trees from the drafter's per-depth top-k: the B best prefixes (widths
  // empty), or JetSpec's build (each expanded node takes widths[depth] children).
  m.def(
      "build_tree(Tensor root_tokens, Tensor topk_logprobs, Tensor topk_ids, int budget, "
      "bool spine, int[] widths=[]) -> (Tensor token_ids, Tensor parents, Tensor depths, "
      "Tensor first_child, Tensor next_sibling, Tensor ancestor_mask, Tensor scores)");
  // Walk each tree along the target's choices: accepted nodes, their count, emitted tokens.
  m.def(
      "verify_tree(Tensor token_ids, Tensor first_child, Tensor next_sibling, "
      "Tensor target_tokens, int max_depth) -> (Tensor accepted, Tensor num_accepted, "
      "Tensor output_tokens)");
  // Move accepted nodes' KV entries and hidden rows to the slots right after the root.
  m.def(
      "compact_tree(Tensor(a!)[] kv_caches, Tensor(b!) hidden_states, Tensor slot_mapping, "
      "Tensor query_start_loc, Tensor accepted, Tensor num_accepted) -> ()");
}
