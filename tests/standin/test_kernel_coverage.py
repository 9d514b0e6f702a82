"""Which of V2's Triton kernels have PyTorch versions in the stand-in, and which still run in
Triton's interpreter on CPU: every kernel the plain, dflash, sampling and hybrid paths
launch each step has one (issue 40's list), and the rest are named in
interpreted_kernels.txt."""

from __future__ import annotations

from pathlib import Path

from cpu_standin import kernels

LISTED = Path(__file__).with_name("interpreted_kernels.txt")

STEP_KERNELS = {
    # plain decoding
    "vllm.v1.worker.gpu.input_batch._prepare_pos_seq_lens_kernel",
    "vllm.v1.worker.gpu.input_batch._combine_sampled_and_draft_tokens_kernel",
    "vllm.v1.worker.gpu.block_table._gather_block_tables_kernel",
    "vllm.v1.worker.gpu.block_table._compute_slot_mappings_kernel",
    "vllm.v1.worker.gpu.sample.gumbel._gumbel_sample_kernel",
    "vllm.v1.worker.gpu.sample.gumbel._gumbel_combine_kernel",
    "vllm.v1.worker.gpu.input_batch._get_num_sampled_and_rejected_kernel",
    "vllm.v1.worker.gpu.input_batch._post_update_kernel",
    "vllm.v1.worker.gpu.buffer_utils._apply_write_kernel",
    "vllm.v1.worker.gpu.input_batch._prepare_prefill_inputs_kernel",
    # dflash
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator._prepare_dflash_inputs_kernel",
    "vllm.v1.worker.gpu.input_batch._expand_idx_mapping_kernel",
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler._gather_draft_sampled_kernel",
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils._compute_local_logits_stats_kernel",
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils._rejection_kernel",
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils._resample_kernel",
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils._insert_resampled_kernel",
    # sampling parameters
    "vllm.v1.worker.gpu.sample.logit_bias._bias_kernel",
    "vllm.v1.worker.gpu.sample.penalties._penalties_kernel",
    "vllm.v1.worker.gpu.sample.gumbel._temperature_kernel",
    "vllm.v1.worker.gpu.sample.logprob._topk_log_softmax_kernel",
    "vllm.v1.worker.gpu.sample.logprob._ranks_kernel",
    "vllm.v1.worker.gpu.sample.penalties._bincount_kernel",
    # hybrid (Gated DeltaNet) targets
    "vllm.v1.worker.utils._zero_kv_blocks_kernel",
    "vllm.v1.worker.gpu.model_states.mamba_hybrid._scatter_num_accepted_kernel",
    "vllm.v1.worker.mamba_utils.preprocess_mamba_align_fused_kernel",
    "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel",
    "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel",
}


def test_every_kernel_a_step_launches_has_a_pytorch_version() -> None:
    assert STEP_KERNELS - set(kernels.load()) == set()


def test_pytorch_versions_name_real_kernels() -> None:
    # Under TRITON_INTERPRET a kernel is an InterpretedFunction, else a JITFunction: both
    # are KernelInterfaces.
    from triton.runtime.jit import KernelInterface
    from vllm.triton_utils import dispatcher

    for name in kernels.load():
        host, attr = dispatcher._resolve_kernel(name)
        kernel = getattr(host, attr)
        assert isinstance(kernel, (KernelInterface, dispatcher.KernelOverride)), name


def test_the_kernels_still_interpreted_are_the_listed_ones() -> None:
    listed = [line for line in LISTED.read_text().splitlines()
              if line and not line.startswith("#")]
    interpreted = kernels.interpreted()
    assert interpreted == listed, "update tests/standin/interpreted_kernels.txt"
    assert STEP_KERNELS.isdisjoint(interpreted)
