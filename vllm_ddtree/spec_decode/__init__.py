"""ddtree and jetspec on vLLM 0.34's Model Runner V2, one file a part of the step:
``config`` (the methods in vLLM's speculator registry), ``speculator`` (drafting trees),
``model_state`` (the hooks into the runner's step), ``verifier`` (tree positions, the walk,
logprobs), ``compaction`` (the accepted path's KV entries)."""
