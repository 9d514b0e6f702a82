"""Start-up compilation of DDTree's Triton kernels, so that none compiles on a real step.

Triton compiles a kernel per launch configuration (constexprs, and the specialization of
its arguments: dtypes, pointer alignment, integers equal to 1 or divisible by 16) on its
first launch. vLLM's warm-up and CUDA-graph capture run the target with no attention
metadata (TREE_ATTN's forward returns at once then) or with capture metadata of a few
sizes, and never build a tree, so without this the tree kernel's split variants, its merge
kernel and the log-sum-exp kernel would compile on the first real steps that pick them.

The worker patch (patches/0009) calls ``warm_up`` once the KV caches exist, before vLLM's
kernel warm-up and CUDA-graph capture. DFlash's input-copy kernel is vLLM's, compiled by
vLLM's JIT warm-up (kernel_warmup, on a GPU, unless enable_jit_warmup is off, as in eager
mode) from registrations: ``warm_up`` registers it at the values ddtree's steps launch it
with.
"""

from __future__ import annotations

from typing import Any


def warm_up(runner: Any) -> None:
    """Compile every variant of the package's kernels this engine can launch:

    - one dummy forward of the target with attention metadata (vLLM's own
      ``_dummy_run(force_attention=True)``), in which every TREE_ATTN layer launches the
      tree kernel at each split count ``auto_splits`` can pick for this engine's batches,
      merge kernel included, with the forward's own arguments (so its windowed layers'
      unsplit variant too): backend.warming_up;
    - the drafter's tree build on logits of the drafter's own (ranked_topk on CUDA, one
      compiled key for every batch);

    and register DFlash's input copy for vLLM's JIT warm-up. Trees do not change a launch's
    configuration (they are data), nor do batch sizes beyond the split count
    (triton_tree_attention keeps its other integer arguments' specialization fixed)."""
    from vllm.config import CUDAGraphMode

    from vllm_ddtree.attention import backend

    with runner.jit_warmup_registry.activate():
        register_input_copy_warm_up(runner)
    with backend.warming_up(runner.max_num_tokens, runner.max_num_reqs):
        runner._dummy_run(1, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
                          skip_eplb=True)
    runner.drafter.warm_up()


def register_input_copy_warm_up(runner: Any) -> None:
    """DFlash's input copy at the values ddtree's steps launch it with. DFlash registers it
    itself when constructed, but then its block size is not set yet (-1), and it registers
    num_speculative_tokens, for ddtree the budget; ddtree's proposer drafts tree_depth
    positions, or none where dynamic speculative decoding schedules no drafts. The kernel
    specializes on these integers (value 1, divisibility by 16)."""
    from vllm.v1.spec_decode.utils import _copy_and_expand_dflash_inputs

    drafter = runner.drafter
    counts = {drafter.depth}
    schedule = drafter.speculative_config.num_speculative_tokens_per_batch_size or []
    if any(n == 0 for *_, n in schedule):
        counts.add(0)
    # The block table the drafter's steps read: its KV-cache group's.
    table = runner.input_batch.block_table[drafter.kv_cache_gid].get_device_tensor(1)
    for count in sorted(counts):
        _copy_and_expand_dflash_inputs.register_warmup(
            block_table_stride=table.stride(0),
            parallel_drafting_token_id=drafter.parallel_drafting_token_id,
            block_size=drafter.block_size, num_speculative_tokens=count)
