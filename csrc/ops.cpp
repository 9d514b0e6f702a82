// The vllm_ddtree operator library: schemas here, one implementation per device in cpu/ and
// cuda/. Fake (meta) implementations live in vllm_ddtree/ops.py.
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
}
