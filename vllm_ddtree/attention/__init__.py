"""Tree attention: a verify step's queries see the committed context, and the tree's nodes
see only their ancestors and themselves (vllm_ddtree/tree.py's ``ancestor_mask``)."""

# TREE_ATTN's two backends: registered by name, this platform's one (spec_decode/config.py's
# register); on CPU, where the platform answers CPU_ATTN whatever is selected, the CPU
# backend also replaces CPU_ATTN (spec_decode/speculator.py). No patch: vLLM's registry.
CPU_BACKEND_PATH = "vllm_ddtree.attention.cpu_backend.TreeAttentionCPUBackend"
CUDA_BACKEND_PATH = "vllm_ddtree.attention.backend.TreeAttentionBackend"
