"""Recurrent layers on a token tree: Gated DeltaNet's conv and gated delta rule for every
tree node over its own path, and the commit of the accepted path (reference.py: the float64
definition; torch_tree_gdn.py: the CPU path; triton_tree_gdn.py: the CUDA kernels)."""
