"""The training side of the tiny pair (scripts/train_tiny_pair.py) computes what vLLM computes:
its drafter (DFlash's, or a JetSpec head's) gives the logits of vLLM's DFlashQwen3ForCausalLM
at every step of a real generation, and its target the log-probs of vLLM's Qwen3, for the
same weights; and a short training run writes checkpoints that vLLM loads and resumes where
it stopped."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import train_tiny_pair as ttp

SMALL = ttp.Recipe(
    target=ttp.Shape(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    drafter=ttp.Shape(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    seq_len=64, batch=2, anchors_per_seq=4, num_prompts=4, prompt_len=16, checkpoint_every=2)
PROMPT = "def parse(self, text):\n    for line in text.splitlines():\n"


def randomized(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, norms included (ones would hide a missing norm weight)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.08 * noise)


@pytest.fixture(scope="module", params=[False, True], ids=["dflash", "jetspec"])
def random_pair(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory, request):
    """The training code's pair with random weights, saved as vLLM loads it: with a DFlash
    drafter, or a JetSpec head (causal in-block attention, dflash_config.causal_head)."""
    recipe = replace(SMALL, causal_head=request.param)
    out = tmp_path_factory.mktemp("trained_format")
    shutil.copytree(tiny_models / "target", out / "target",
                    ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    vocab = json.loads((tiny_models / "target" / "config.json").read_text())["vocab_size"]
    _, eos, mask_id = ttp.special_ids(out / "target")
    target = ttp.Target(recipe, vocab)
    randomized(target, seed=1)
    drafter = ttp.Drafter(recipe, target)
    randomized(drafter, seed=2)
    target.eval().requires_grad_(False)
    drafter.eval().requires_grad_(False)
    ttp.save_target(recipe, target, out / "target", vocab, eos)
    ttp.save_drafter(recipe, drafter, out / "drafter", vocab, eos, mask_id)
    return out, target, drafter, mask_id, recipe


@pytest.mark.slow
def test_drafter_and_target_match_vllm(random_pair, monkeypatch) -> None:
    from vllm import LLM, SamplingParams

    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    out, target, drafter, mask_id, recipe = random_pair
    depth = SMALL.block_size - 1
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    vllm_draft_logits = DDTreeSpeculator.draft_logits_at

    def recording(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = vllm_draft_logits(self, hidden_states)
        # The mask queries' positions (the rows the logits are of).
        positions = self.input_buffers.positions[self.sample_indices[:logits.shape[0]]]
        steps.append((positions.clone(), logits.clone()))
        return logits

    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", recording)
    common = dict(enforce_eager=True, max_model_len=256, seed=0, dtype="float32",
                  max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=str(out / "target"), **common, speculative_config={
        "method": "ddtree", "model": str(out / "drafter"), "tree_budget": 16})
    result = llm.generate([PROMPT], params, use_tqdm=False)[0]
    del llm
    prompt_ids, generated = list(result.prompt_token_ids), list(result.outputs[0].token_ids)
    seq = torch.tensor(prompt_ids + generated)
    assert len(steps) >= 3

    # The target: the log-prob vLLM's Qwen3 gives each token it generates alone.
    llm = LLM(model=str(out / "target"), **common)
    params.logprobs = 0
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert list(alone.token_ids) == generated
    logits, _ = target(seq[None, :-1])
    ours = torch.log_softmax(logits[0, len(prompt_ids) - 1:], -1)
    for i, (token, lp) in enumerate(zip(generated, alone.logprobs)):
        assert ours[i, token].item() == pytest.approx(lp[token].logprob, abs=2e-4)
        assert ours[i].argmax().item() == token

    # The drafter: at each step, context = every token before the bonus token.
    for positions, vllm_logits in steps:
        n = int(positions[0]) - 1  # the bonus token's position
        assert positions.tolist() == list(range(n + 1, n + 1 + depth))
        _, ctx = target(seq[None, :n])
        block = torch.tensor([[int(seq[n])] + [mask_id] * depth])
        mask = torch.ones(1, 1 + depth, n + 1 + depth, dtype=torch.bool)
        if recipe.causal_head:  # the block's later queries are hidden from earlier ones
            mask[0, :, n:] = torch.ones(1 + depth, 1 + depth, dtype=torch.bool).tril()
        ours = drafter(block, torch.arange(n, n + 1 + depth)[None], ctx,
                       torch.arange(n)[None], mask)[0, 1:]
        torch.testing.assert_close(ours, vllm_logits, atol=2e-4, rtol=1e-4)


def test_short_training_resumes_exactly(tmp_path: Path,
                                                                monkeypatch) -> None:
    # A small corpus keeps the test short; the held-out split still comes from corpus_split.
    train_files, held_files = ttp.corpus_split()
    small = [f for f in train_files if f.name in {"argparse.py", "typing.py", "enum.py"}]
    assert small and not set(small) & set(held_files)
    monkeypatch.setattr(ttp, "corpus_split", lambda: (small, held_files[:2]))
    recipe = replace(SMALL, vocab_size=512, target_steps=4, drafter_steps=4)

    # A run interrupted during its third target step keeps the checkpoint of step 2...
    target_loss, calls = ttp._target_loss, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return target_loss(*args)

    monkeypatch.setattr(ttp, "_target_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ttp.run(tmp_path, recipe)
    assert torch.load(tmp_path / "train" / "target.pt", weights_only=True)["step"] == 2
    assert not (tmp_path / "drafter").exists()
    monkeypatch.setattr(ttp, "_target_loss", target_loss)
    ttp.run(tmp_path, recipe)  # ...and a rerun continues from there, then trains the drafter
    assert torch.load(tmp_path / "train" / "drafter.pt", weights_only=True)["step"] == 4

    # Resuming with other settings is refused, naming them.
    with pytest.raises(ValueError, match="drafter_steps"):
        ttp.run(tmp_path, replace(recipe, drafter_steps=5))

    # Resuming is exact: the same weights as one uninterrupted run.
    straight = tmp_path / "straight"
    ttp.run(straight, recipe)
    for stage in ("target", "drafter"):
        a = torch.load(tmp_path / "train" / f"{stage}.pt", weights_only=True)["model"]
        b = torch.load(straight / "train" / f"{stage}.pt", weights_only=True)["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), stage

    prompts = json.loads((tmp_path / "heldout_prompts.json").read_text())
    assert len(prompts) == recipe.num_prompts and {len(p) for p in prompts} == {16}
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["dflash_config"][
        "mask_token_id"] == ttp.special_ids(tmp_path / "target")[2]
