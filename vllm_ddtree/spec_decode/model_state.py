"""The glue into V2's step: the target's ModelState, subclassed for trees.

V2's speculator interface ends at drafting: it reaches neither the verify forward's
positions, nor its attention metadata, nor the acceptance rule. The runner asks its
ModelState for all three (``preprocess_state`` after the slot mappings are computed and
before the attention metadata is built; ``prepare_inputs`` for M-RoPE positions;
``custom_sampler`` for the rejection sampler; ``dummy_sampler_run`` for the start-up memory
profile of a verify step's sampling), and
takes the ModelState class from the target model's ``get_model_state_cls`` when it has one.
The speculator's ``load_model`` runs before the runner makes its ModelState, so it gives the
target model that method, returning the class vLLM would have chosen with ddtree's hooks on
top. That keeps the whole step in the plugin, without a patch to the runner.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.v1.worker.gpu.model_states import resolve_model_state_cls

from vllm_ddtree.spec_decode import node_sampling
from vllm_ddtree.spec_decode.verifier import TreeVerifier


def install_model_state(vllm_config: Any, target_model: Any, verifier: TreeVerifier) -> None:
    base = resolve_model_state_cls(vllm_config, target_model)

    class DDTreeModelState(base):
        def add_request(self, req_index: int, new_req_data: Any) -> None:
            super().add_request(req_index, new_req_data)
            verifier.add_request(req_index, new_req_data.sampling_params)

        def preprocess_state(self, input_batch: Any, block_tables: Any, kv_cache_config: Any,
                             num_computed_tokens: Any) -> None:
            super().preprocess_state(input_batch, block_tables, kv_cache_config,
                                     num_computed_tokens)
            verifier.begin_step(input_batch)

        def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
            inputs = super().prepare_inputs(input_batch, req_states)
            verifier.shift_rope_positions(inputs.get("positions"))
            return inputs

        def custom_sampler(self, sampler: Any) -> tuple[Any, Any]:
            base_choice = super().custom_sampler(sampler)
            if base_choice is not None:
                raise ValueError(f"method 'ddtree': the target's model state "
                                 f"({base.__name__}) brings its own sampler")
            return sampler, verifier.with_sampler(sampler)

        def dummy_sampler_run(self, sampler: Any, hidden_states: torch.Tensor) -> bool:
            # V2's start-up memory profile samples a row a request; a verify step samples
            # budget + 1 a request: the profile takes the largest verify step's sampling
            # too, so that its peak is paid for before the KV cache is sized. With every
            # processing stage on, except on CPU (vLLM's own reason: its KV cache is sized
            # from the process's resident memory after the profile).
            rows = node_sampling.max_verify_rows(self.vllm_config, verifier.budget)
            node_sampling.profile_verify_step(
                sampler, self.model, hidden_states, rows, verifier.budget,
                verifier.max_depth + 1, processing=not current_platform.is_cpu())
            return super().dummy_sampler_run(sampler, hidden_states)

    DDTreeModelState.__name__ = DDTreeModelState.__qualname__ = f"DDTree{base.__name__}"
    target_model.get_model_state_cls = lambda: DDTreeModelState
