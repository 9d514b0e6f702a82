#!/usr/bin/env python3
"""Write a tiny target/drafter pair, offline and deterministically from a seed.

DIR/target:  a random Qwen3 (head_dim 32) with a byte-level BPE tokenizer trained here on
             the Python standard library's source, and a chat template.
DIR/drafter: a random DFlash drafter in the z-lab checkpoint format (DFlashDraftModel,
             block_size, dflash_config.{mask_token_id,target_layer_ids}, real safetensors;
             no embedding or LM head: it shares the target's).

Random weights prove the plumbing, not acceptance: scripts/train_tiny_pair.py trains a pair.
--hybrid: DIR/target is a hand-built Qwen3-Next instead (3 Gated DeltaNet layers, 1 full
attention, bf16) whose greedy choices have large margins (make_hybrid), for exactness tests;
--hybrid qwen3_5: the same model as Qwen3.5 (Qwen3_5ForConditionalGeneration, M-RoPE);
--hybrid qwen3_5_text: as a text-only Qwen3.5 (Qwen3_5ForCausalLM).
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


def make(out: Path, seed: int = 0, vocab_size: int | None = None, layers: int | None = None,
         hidden_size: int | None = None) -> None:
    """The random pair; ``vocab_size`` (at least the tokenizer's 1,000 tokens; e.g. Qwen3's
    151,936, for memory measurements: ids past the tokenizer's are padding), ``layers`` and
    ``hidden_size`` (the MLP twice as wide) change the target's shape from TARGET."""
    gen = torch.Generator().manual_seed(seed)
    target, drafter = out / "target", out / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    tok_vocab = train_tokenizer(target, vocab_size=1000)
    vocab = (tok_vocab + 63) // 64 * 64  # padded, as real checkpoints are
    if vocab_size is not None:
        if vocab_size < tok_vocab:
            raise ValueError(f"--vocab-size {vocab_size}: the tokenizer has {tok_vocab} tokens")
        vocab = vocab_size
    shape = dict(TARGET)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if hidden_size is not None:
        shape |= dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size)
    tok = json.loads((target / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos, mask = ids["<|im_end|>"], ids["<|mask|>"]

    h = shape["hidden_size"]
    weights = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen) * 0.5,
               "model.norm.weight": torch.ones(h),
               "lm_head.weight": torch.randn(vocab, h, generator=gen) * 0.1}
    for n in range(shape["num_hidden_layers"]):
        weights |= layer_weights(f"model.layers.{n}", shape, gen)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(qwen3_config(shape, vocab, eos), indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))

    write_drafter(drafter, shape, vocab, eos, mask, gen)


def target_layer_ids(target: dict) -> list[int]:
    """The target layers whose hidden states the drafter reads: TARGET_LAYER_IDS, or for a
    target of fewer layers the first and the middle one."""
    n = target["num_hidden_layers"]
    return TARGET_LAYER_IDS if max(TARGET_LAYER_IDS) < n else [0, n // 2]


def write_drafter(drafter: Path, target: dict, vocab: int, eos: int, mask: int,
                  gen: torch.Generator, **extra) -> None:
    """A random DFlash drafter for a target of shape ``target`` (its vocabulary; its hidden
    size, which vLLM's DFlash takes for the drafter's own)."""
    h = target["hidden_size"]
    shape = DRAFTER if h == DRAFTER["hidden_size"] else DRAFTER | dict(
        hidden_size=h, intermediate_size=2 * h)
    layer_ids = target_layer_ids(target)
    weights = {"fc.weight": torch.randn(h, h * len(layer_ids), generator=gen) * 0.05,
               "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
    for n in range(shape["num_hidden_layers"]):
        weights |= layer_weights(f"layers.{n}", shape, gen)
    save_file(weights, drafter / "model.safetensors", metadata={"format": "pt"})
    config = qwen3_config(
        shape, vocab, eos, architectures=["DFlashDraftModel"], block_size=BLOCK_SIZE,
        num_target_layers=target["num_hidden_layers"],
        dflash_config={"mask_token_id": mask, "target_layer_ids": layer_ids}, **extra)
    (drafter / "config.json").write_text(json.dumps(config, indent=2))


HYBRID = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"],
              num_attention_heads=2, num_key_value_heads=1, head_dim=64,
              linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=2,
              num_experts_per_tok=1, moe_intermediate_size=64,
              shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
N_CLASSES = 8            # keys per GDN layer (one-hot, plus a start slot)
GDN_SHIFTS = (1, 2, 3)   # GDN layer n keys token t's value by the class of token t - shift
GDN_BITS = (2, 2, 1)     # value bits each GDN layer stores and retrieves
ATTN_SHIFTS = (1, 2)     # attention head h copies a bit of token t - shift (RoPE alone)
CUR_BITS = 2             # bits of the current token passed straight to the LM head
ROPE_THETA = 2.0         # 8 rotary frequencies 2**(-i/8); weights: score peak at the shift
ROPE_WEIGHTS = [0.154, 0.044, 0.019, 0.191, 0.197, 0.064, 0.1, 0.23]  # others <= 0.79 peak


def hybrid_layout() -> dict[str, list[list[int]]]:
    """Residual-stream dimensions: the embedding writes cur/cls/val/pbit/one; layer n
    writes gdn[n] (attention: attn[h]); the LM head reads cur + gdn + attn."""
    spans = [("cur", [CUR_BITS]), ("cls", [N_CLASSES] * 3), ("val", list(GDN_BITS)),
             ("pbit", [1]), ("one", [1]), ("gdn", list(GDN_BITS)),
             ("attn", [1] * len(ATTN_SHIFTS))]
    out, at = {}, 0
    for name, sizes in spans:
        out[name] = []
        for size in sizes:
            out[name].append(list(range(at, at + size)))
            at += size
    return out


def hybrid_weights(vocab: int, outputs: list[int], gen: torch.Generator
                   ) -> dict[str, torch.Tensor]:
    c = HYBRID
    h, nl = c["hidden_size"], c["num_hidden_layers"]
    lay = hybrid_layout()
    cur, one, pbit = lay["cur"][0], lay["one"][0][0], lay["pbit"][0][0]

    def signs(*size: int) -> torch.Tensor:
        return torch.randint(0, 2, size, generator=gen).float() * 2 - 1

    # Embedding: random bits and classes, exactly +-1 / one-hot, the same norm for all tokens.
    emb = torch.zeros(vocab, h)
    emb[:, cur] = signs(vocab, len(cur))
    for n in range(3):
        cls = torch.randint(0, N_CLASSES, (vocab,), generator=gen)
        emb[torch.arange(vocab), torch.tensor(lay["cls"][n])[cls]] = 1.0
        emb[:, lay["val"][n]] = signs(vocab, GDN_BITS[n])
    emb[:, pbit] = signs(vocab)
    emb[:, one] = 1.0
    # LM head: output token k has the sign code of k's bits on the decision dims; the
    # others (special and padding tokens among them) read nothing: logit 0.
    decide = cur + sum(lay["gdn"], []) + sum(lay["attn"], [])
    code = torch.tensor([[(k >> b) & 1 for b in range(len(decide))]
                         for k in range(len(outputs))]).float() * 2 - 1
    head = torch.zeros(vocab, h)
    head[torch.tensor(outputs)[:, None], torch.tensor(decide)[None]] = code
    w = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.zeros(h),
         "lm_head.weight": head}

    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    for n in range(nl):
        p = f"model.layers.{n}"
        w[f"{p}.input_layernorm.weight"] = torch.zeros(h)  # Gemma-style: x * (1 + w)
        w[f"{p}.post_attention_layernorm.weight"] = torch.zeros(h)
        mi, si = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        w[f"{p}.mlp.gate.weight"] = torch.zeros(c["num_experts"], h)  # MLPs add nothing
        for e in range(c["num_experts"]):
            w[f"{p}.mlp.experts.{e}.gate_proj.weight"] = torch.zeros(mi, h)
            w[f"{p}.mlp.experts.{e}.up_proj.weight"] = torch.zeros(mi, h)
            w[f"{p}.mlp.experts.{e}.down_proj.weight"] = torch.zeros(h, mi)
        w[f"{p}.mlp.shared_expert.gate_proj.weight"] = torch.zeros(si, h)
        w[f"{p}.mlp.shared_expert.up_proj.weight"] = torch.zeros(si, h)
        w[f"{p}.mlp.shared_expert.down_proj.weight"] = torch.zeros(h, si)
        w[f"{p}.mlp.shared_expert_gate.weight"] = torch.zeros(1, h)
        if c["layer_types"][n] == "linear_attention":
            w |= gdn_weights(f"{p}.linear_attn", n, lay, kd, vd)
        else:
            w |= attention_weights(f"{p}.self_attn", lay)
    return w


def gdn_weights(p: str, n: int, lay: dict, kd: int, vd: int) -> dict[str, torch.Tensor]:
    """One GDN layer as an exact key-value store: beta = 1, no decay, one-hot L2-normed
    keys, so a write replaces its slot. The start slot (key K) takes token 0's value and
    every query reads it at weight ~0.2: a class never written yet reads token 0's value."""
    h, one, k = HYBRID["hidden_size"], lay["one"][0][0], N_CLASSES
    cls, val, out = lay["cls"][n], lay["val"][n], lay["gdn"][n]
    qkvz = torch.zeros(2 * kd + 4 * vd, h)  # one key head: [q | k | v (2 heads) | z (2)]
    conv = torch.zeros(2 * kd + 2 * vd, 4)  # taps: t-3, t-2, t-1, t
    for i in range(k):
        qkvz[i, cls[i]] = 2.0  # query: the current token's class
        conv[i, 3] = 1.0
        qkvz[kd + i, cls[i]] = 2.0  # key: the class of token t - shift
        conv[kd + i, 3 - GDN_SHIFTS[n]] = 1.0
    qkvz[k, one] = 0.5  # the query's start slot: silu(0.5 r) / silu(2 r), about 0.2
    conv[k, 3] = 1.0
    qkvz[kd + k, one] = 1.0  # start key: 3r at t = 0, -7r (silu ~ 0) after it
    conv[kd + k, 2:] = torch.tensor([-10.0, 3.0])
    for j, d in enumerate(val):  # value head 0: each bit as silu(+-2r) on a pair of dims
        qkvz[2 * kd + 2 * j, d], qkvz[2 * kd + 2 * j + 1, d] = 2.0, -2.0
        conv[2 * kd + 2 * j, 3] = conv[2 * kd + 2 * j + 1, 3] = 1.0
    qkvz[2 * kd + 2 * vd: 3 * kd + 2 * vd, one] = 1.0  # z (head 0): silu(r), a constant
    ba = torch.zeros(4, h)  # [b0, b1, a0, a1]
    ba[:2, one] = 8.0  # beta = sigmoid(8r) = 1
    outp = torch.zeros(h, 2 * vd)
    for j, d in enumerate(out):  # +-1: the normed head is ~8 on a live dim, silu(z) ~3
        outp[d, 2 * j], outp[d, 2 * j + 1] = 1 / 24, -1 / 24
    return {f"{p}.in_proj_qkvz.weight": qkvz, f"{p}.in_proj_ba.weight": ba,
            f"{p}.conv1d.weight": conv[:, None, :], f"{p}.dt_bias": torch.zeros(2),
            f"{p}.A_log": torch.full((2,), -30.0), f"{p}.norm.weight": torch.ones(vd),
            f"{p}.out_proj.weight": outp}


def attention_weights(p: str, lay: dict) -> dict[str, torch.Tensor]:
    """Position-only attention: q and k are constant, RoPE makes head h's scores peak at
    t - ATTN_SHIFTS[h] (27 nats above any other position up to 4096), v = the token's
    pbit, so head h copies the pbit of token t - shift (its own at the sequence start)."""
    c, one, pbit = HYBRID, lay["one"][0][0], lay["pbit"][0][0]
    h, d, nh = c["hidden_size"], c["head_dim"], c["num_attention_heads"]
    half = int(d * 0.25) // 2  # rotary pairs (i, i + half), neox style
    theta = ROPE_THETA ** (-torch.arange(half) / half)
    amp = torch.tensor(ROPE_WEIGHTS).sqrt()
    q = torch.zeros(2 * d * nh, h)  # per head: [q | output gate]; gate 0: sigmoid = 1/2
    k = torch.zeros(d, h)
    k[:half, one] = amp
    for head, shift in enumerate(ATTN_SHIFTS):
        q[2 * d * head: 2 * d * head + half, one] = amp * torch.cos(shift * theta)
        q[2 * d * head + half: 2 * d * head + 2 * half, one] = -amp * torch.sin(shift * theta)
    v = torch.zeros(d, h)
    v[0, pbit] = 1.0
    o = torch.zeros(h, d * nh)
    for head in range(nh):
        o[lay["attn"][head][0], d * head] = 0.75  # 1/2 * ~2.7 * 0.75: about +-1
    # q, k are RMS-normed per head (sqrt(d) * unit), then scaled by 4: peak score 8 * 16.
    return {f"{p}.q_proj.weight": q, f"{p}.k_proj.weight": k, f"{p}.v_proj.weight": v,
            f"{p}.o_proj.weight": o, f"{p}.q_norm.weight": torch.full((d,), 3.0),
            f"{p}.k_norm.weight": torch.full((d,), 3.0)}


def with_two_key_heads(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same model with a second GDN key head that reads and writes nothing (zero), so
    tensor parallelism at 2 gives each rank one key head and one value head. Qwen3-Next
    groups in_proj_qkvz as [q | k | v | z] and in_proj_ba as [b | a] per key head, and
    conv1d as [q heads | k heads | v heads]; value head 1 is zero already."""
    kd, vd = HYBRID["linear_key_head_dim"], HYBRID["linear_value_head_dim"]
    out = dict(w)
    for name, t in w.items():
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = t.split([kd, kd, 2 * vd, 2 * vd])
            assert not v[vd:].any() and not z[vd:].any()
            out[name] = torch.cat([q, k, v[:vd], z[:vd], torch.zeros_like(t[:2 * kd + 2 * vd])])
        elif name.endswith("in_proj_ba.weight"):
            out[name] = t[[0, 2, 1, 3]]  # [b0, b1, a0, a1] -> [b0, a0 | b1, a1]
        elif name.endswith("conv1d.weight"):
            q, k, v = t.split([kd, kd, 2 * vd])
            out[name] = torch.cat([q, torch.zeros_like(q), k, torch.zeros_like(k), v])
    return out


def as_qwen3_5(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same model in Qwen3.5's text layout (Qwen3_5ForCausalLM): a dense MLP (zero, as
    the MoE was) and the GDN input projections split. With one key head Qwen3-Next's
    per-key-head groups [q | k | v | z] and [b | a] are the plain concatenations."""
    c, out = HYBRID, {}
    qkv = 2 * c["linear_key_head_dim"] + c["linear_num_value_heads"] * c["linear_value_head_dim"]
    nv = c["linear_num_value_heads"]
    assert c["linear_num_key_heads"] == 1
    for name, t in w.items():
        if ".mlp." in name:
            continue
        if name.endswith("in_proj_qkvz.weight"):
            p = name.removesuffix("qkvz.weight")
            out[p + "qkv.weight"], out[p + "z.weight"] = t[:qkv], t[qkv:]
        elif name.endswith("in_proj_ba.weight"):
            p = name.removesuffix("ba.weight")
            out[p + "b.weight"], out[p + "a.weight"] = t[:nv], t[nv:]
        else:
            out[name] = t
    h, mi = c["hidden_size"], c["intermediate_size"]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}.mlp"
        out[f"{p}.gate_proj.weight"] = torch.zeros(mi, h)
        out[f"{p}.up_proj.weight"] = torch.zeros(mi, h)
        out[f"{p}.down_proj.weight"] = torch.zeros(h, mi)
    return out


def qwen3_5_config(text: dict, vocab: int) -> dict:
    """Qwen3.5 as its checkpoints ship it (Qwen3_5ForConditionalGeneration): the text
    model with M-RoPE (interleaved sections of the 8 rotary pairs), and a tiny vision
    tower that the tests never load (they serve it language-model-only: limit_mm_per_prompt
    0), so the checkpoint holds no vision weights. A text token's position is the same on
    every M-RoPE axis, so it rotates as 1-D RoPE does."""
    text = {k: v for k, v in text.items() if k not in MOE_KEYS and k != "architectures"}
    text["model_type"] = "qwen3_5_text"
    text["rope_parameters"] = text["rope_parameters"] | {"mrope_section": [2, 3, 3],
                                                        "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  out_hidden_size=text["hidden_size"], num_position_embeddings=64,
                  deepstack_visual_indexes=[])
    # The vision tokens: unused ids past the tokenizer's (the vocabulary is padded).
    image, video, start, end = range(vocab - 4, vocab)
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text, "vision_config": vision, "image_token_id": image,
            "video_token_id": video, "vision_start_token_id": start,
            "vision_end_token_id": end, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_text")
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
            "norm_topk_prob")


def make_hybrid(out: Path, seed: int = 0, arch: str = "qwen3_next", key_heads: int = 1
                ) -> None:
    """DIR/target: a tiny Qwen3-Next (3 GDN layers, 1 full attention, MLPs zero) built by
    hand, not drawn, so greedy choices have margins far above bf16 noise; DIR/drafter: DFlash.
    ``arch`` "qwen3_5": the same model as Qwen3.5 ships (Qwen3_5ForConditionalGeneration:
    split GDN projections, a dense MLP, M-RoPE), which computes the same function;
    "qwen3_5_text": as a text-only Qwen3.5 checkpoint (Qwen3_5ForCausalLM). ``key_heads`` 2
    (Qwen3-Next only): a second, silent GDN key head, so the target shards over two ranks.

    Tokens carry random exact +-1 bits and classes. GDN layer n is an exact key-value store
    (beta 1, no decay, one-hot keys): it files token t's bits under the class of token
    t - n - 1 (a conv tap) and the current token's class reads them back; attention copies
    a bit of token t - 1 and t - 2 (RoPE alone). The LM head matches the sign code of 9 bits
    (2 of the token, 5 recalled by GDN, 2 by attention) over 512 tokens: every top-1/top-2
    gap is 2 * min |bit| (3.5-5 nats in vLLM bf16), never a near-tie, and all layers count.
    """
    gen = torch.Generator().manual_seed(seed)
    target, drafter = out / "target", out / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    tok_vocab = train_tokenizer(target, vocab_size=1000)
    vocab = (tok_vocab + 63) // 64 * 64
    tok = json.loads((target / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos, mask = ids["<|im_end|>"], ids["<|mask|>"]
    n_bits = CUR_BITS + sum(GDN_BITS) + len(ATTN_SHIFTS)
    plain = torch.tensor([i for i in range(tok_vocab) if i not in ids.values()])
    outputs = plain[torch.randperm(len(plain), generator=gen)[: 2**n_bits]].tolist()

    weights = hybrid_weights(vocab, outputs, gen)
    assert key_heads in (1, 2) and (key_heads == 1 or arch == "qwen3_next")
    if key_heads == 2:
        weights = with_two_key_heads(weights)
    if arch == "qwen3_5":  # the language model's weights, as Qwen3.5's checkpoints name them
        weights = {k.replace("model.", "model.language_model.", 1): v
                   for k, v in as_qwen3_5(weights).items()}
    elif arch == "qwen3_5_text":
        weights = as_qwen3_5(weights)
    weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": vocab, **HYBRID, "linear_num_key_heads": key_heads,
        "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default",
                                                  "rope_theta": ROPE_THETA,
                                                  "partial_rotary_factor": 0.25},
        "partial_rotary_factor": 0.25, "attention_bias": False, "attention_dropout": 0.0,
        "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": eos, "eos_token_id": eos, "use_cache": True,
    }
    if arch == "qwen3_5":
        config = qwen3_5_config(config, vocab)
    elif arch == "qwen3_5_text":  # vLLM's text-only class: 1-D RoPE (it drops M-RoPE)
        config = qwen3_5_config(config, vocab)["text_config"] | {
            "architectures": ["Qwen3_5ForCausalLM"]}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    write_drafter(drafter, HYBRID, vocab, eos, mask, gen, torch_dtype="bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hybrid", nargs="?", const="qwen3_next", choices=HYBRID_ARCHS,
                        help="a hand-built hybrid target (GDN + attention) instead: "
                        "Qwen3-Next (the default) or the same model as a Qwen3.5 text model")
    parser.add_argument("--key-heads", type=int, default=1, choices=(1, 2),
                        help="GDN key heads of the hybrid (2: it shards over two ranks)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the random pair's vocabulary (e.g. 151936, Qwen3's): ids past "
                        "the tokenizer's 1,000 are padding")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"the random target's layers ({TARGET['num_hidden_layers']})")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help=f"the random target's hidden size ({TARGET['hidden_size']})")
    args = parser.parse_args()
    if args.hybrid:
        if (args.vocab_size, args.layers, args.hidden_size) != (None, None, None):
            parser.error("--vocab-size, --layers, --hidden-size: the random pair's only")
        make_hybrid(args.out, args.seed, args.hybrid, args.key_heads)
    else:
        make(args.out, args.seed, args.vocab_size, args.layers, args.hidden_size)
    print(f"wrote {args.out / 'target'} and {args.out / 'drafter'}")


if __name__ == "__main__":
    main()
