"""Tree attention: a verify step's queries see the committed context, and the tree's nodes
see only their ancestors and themselves (vllm_ddtree/tree.py's ``ancestor_mask``)."""

# The CPU platform's selection hook (patches/0003) asks for this when TREE_ATTN is chosen;
# the AttentionBackendEnum member (patches/0002) points at the CUDA backend.
CPU_BACKEND_PATH = "vllm_ddtree.attention.cpu_backend.TreeAttentionCPUBackend"
CUDA_BACKEND_PATH = "vllm_ddtree.attention.backend.TreeAttentionBackend"
