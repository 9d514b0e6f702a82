"""scripts/make_tiny_models.py: deterministic, offline, in the real checkpoint formats."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import make_tiny_models
from safetensors import safe_open


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes(tiny_models: Path, tmp_path: Path) -> None:
    make_tiny_models.make(tmp_path / "again", seed=0)
    assert digests(tmp_path / "again") == digests(tiny_models)
    make_tiny_models.make(tmp_path / "other", seed=1)
    other = digests(tmp_path / "other")
    assert other["target/model.safetensors"] != digests(tiny_models)["target/model.safetensors"]


def test_drafter_is_in_the_dflash_checkpoint_format(tiny_models: Path) -> None:
    target = json.loads((tiny_models / "target/config.json").read_text())
    drafter = json.loads((tiny_models / "drafter/config.json").read_text())
    assert drafter["architectures"] == ["DFlashDraftModel"] and drafter["model_type"] == "qwen3"
    assert drafter["block_size"] >= 2 and drafter["vocab_size"] == target["vocab_size"]
    layer_ids = drafter["dflash_config"]["target_layer_ids"]
    assert all(0 <= i < target["num_hidden_layers"] for i in layer_ids)
    vocab = json.loads((tiny_models / "target/tokenizer.json").read_text())["added_tokens"]
    assert {"id": drafter["dflash_config"]["mask_token_id"]}.items() <= next(
        t for t in vocab if t["content"] == "<|mask|>").items()
    assert target["head_dim"] >= 32
    with safe_open(tiny_models / "drafter/model.safetensors", "pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("fc.weight")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert fc.shape == (drafter["hidden_size"], target["hidden_size"] * len(layer_ids))


def test_tokenizer_round_trips_and_has_a_chat_template(tiny_models: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models / "target")
    text = "def answer(x):\n    return x * 42  # ünïcode"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_the_random_pair_takes_a_vocabulary_and_a_shape(tmp_path: Path) -> None:
    """--vocab-size (Qwen3's: ids past the tokenizer's are padding), --layers, --hidden-size:
    the drafter shares the target's hidden size and reads layers the target has."""
    make_tiny_models.make(tmp_path, seed=0, vocab_size=151_936, layers=2, hidden_size=64)
    target = json.loads((tmp_path / "target/config.json").read_text())
    drafter = json.loads((tmp_path / "drafter/config.json").read_text())
    assert (target["vocab_size"], target["num_hidden_layers"], target["hidden_size"]) == (
        151_936, 2, 64)
    assert (drafter["vocab_size"], drafter["hidden_size"]) == (151_936, 64)
    assert drafter["dflash_config"]["target_layer_ids"] == [0, 1]
    with safe_open(tmp_path / "target/model.safetensors", "pt") as f:
        assert f.get_slice("lm_head.weight").get_shape() == [151_936, 64]
    with safe_open(tmp_path / "drafter/model.safetensors", "pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [64, 128]
