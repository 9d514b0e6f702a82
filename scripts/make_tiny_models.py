#!/usr/bin/env python3
"""Write a tiny target/drafter pair, offline and deterministically from a seed.

DIR/target:  a random Qwen3 (head_dim 32) with a byte-level BPE tokenizer trained here on
             the Python standard library's source, and a chat template.
DIR/drafter: a random DFlash drafter in the z-lab checkpoint format (DFlashDraftModel,
             block_size, dflash_config.{mask_token_id,target_layer_ids}, real safetensors;
             no embedding or LM head: it shares the target's).

Random weights prove the plumbing, not acceptance: scripts/train_tiny_pair.py trains a pair.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Modules whose source trains the tokenizer: fixed, so the vocabulary is reproducible.
CORPUS_MODULES = ["argparse", "collections/__init__", "dataclasses", "functools", "json/decoder",
                  "pathlib", "textwrap", "typing", "string", "heapq", "bisect", "enum"]

TARGET = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32)
DRAFTER = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32)
BLOCK_SIZE = 8
TARGET_LAYER_IDS = [0, 2]


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / f"{m}.py" for m in CORPUS_MODULES]


def train_tokenizer(out: Path, vocab_size: int, files: list[Path] | None = None) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in files or corpus_files()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>", "<|mask|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def qwen3_config(shape: dict, vocab_size: int, eos: int, **extra) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab_size, **shape, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": eos, "eos_token_id": eos,
        "use_cache": True, **extra,
    }


def layer_weights(prefix: str, shape: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def rnd(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * 0.05

    return {
        f"{prefix}.self_attn.q_proj.weight": rnd(q, h),
        f"{prefix}.self_attn.k_proj.weight": rnd(kv, h),
        f"{prefix}.self_attn.v_proj.weight": rnd(kv, h),
        f"{prefix}.self_attn.o_proj.weight": rnd(h, q),
        f"{prefix}.self_attn.q_norm.weight": torch.ones(d),
        f"{prefix}.self_attn.k_norm.weight": torch.ones(d),
        f"{prefix}.mlp.gate_proj.weight": rnd(i, h),
        f"{prefix}.mlp.up_proj.weight": rnd(i, h),
        f"{prefix}.mlp.down_proj.weight": rnd(h, i),
        f"{prefix}.input_layernorm.weight": torch.ones(h),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
    }


def make(out: Path, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    target, drafter = out / "target", out / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    tok_vocab = train_tokenizer(target, vocab_size=1000)
    vocab = (tok_vocab + 63) // 64 * 64  # padded, as real checkpoints are
    tok = json.loads((target / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos, mask = ids["<|im_end|>"], ids["<|mask|>"]

    h = TARGET["hidden_size"]
    weights = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen) * 0.5,
               "model.norm.weight": torch.ones(h),
               "lm_head.weight": torch.randn(vocab, h, generator=gen) * 0.1}
    for n in range(TARGET["num_hidden_layers"]):
        weights |= layer_weights(f"model.layers.{n}", TARGET, gen)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(qwen3_config(TARGET, vocab, eos), indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))

    dh = DRAFTER["hidden_size"]
    weights = {"fc.weight": torch.randn(dh, h * len(TARGET_LAYER_IDS), generator=gen) * 0.05,
               "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(dh)}
    for n in range(DRAFTER["num_hidden_layers"]):
        weights |= layer_weights(f"layers.{n}", DRAFTER, gen)
    save_file(weights, drafter / "model.safetensors", metadata={"format": "pt"})
    config = qwen3_config(
        DRAFTER, vocab, eos, architectures=["DFlashDraftModel"], block_size=BLOCK_SIZE,
        num_target_layers=TARGET["num_hidden_layers"],
        dflash_config={"mask_token_id": mask, "target_layer_ids": TARGET_LAYER_IDS})
    (drafter / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make(args.out, args.seed)
    print(f"wrote {args.out / 'target'} and {args.out / 'drafter'}")


if __name__ == "__main__":
    main()
