"""Tree attention: a verify step's queries see the committed context, and the tree's nodes
see only their ancestors and themselves (vllm_ddtree/tree.py's ``ancestor_mask``)."""
