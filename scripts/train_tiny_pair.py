#!/usr/bin/env python3
"""Train a tiny Qwen3 target and a DFlash drafter against it, on CPU, offline.

Corpus: the Python standard library's source on this machine, split by file into a training
and a held-out part (a file's split depends only on its path). Stages, each resumable:

1. tokenizer: byte-level BPE trained on the training files (make_tiny_models.train_tokenizer);
2. target: a small Qwen3 trained with next-token cross-entropy;
3. drafter: a DFlash drafter trained against the frozen target with the block objective:
   an anchor token followed by mask tokens, conditioned on the target's hidden states after
   ``target_layer_ids`` at every earlier position, loss decaying with depth;
4. held-out prompts (token ids) for scripts/bench_acceptance.py.

--jetspec: a JetSpec head (arXiv 2606.18394) instead, for an already trained target
(--target, default the shipped pair's; its tokenizer and weights are copied, not trained):
the same drafter with causal attention inside the block, trained by forward-KL distillation
against the frozen target's distribution at every block position, saved in JetSpec's
checkpoint format (DFlash's, with dflash_config.causal_head: true).

OUT/target and OUT/drafter are written in the formats vLLM loads (the z-lab format for the
drafter, as make_tiny_models.py writes it). Deterministic from --seed on a given machine;
OUT/train/*.pt hold the last checkpoint of each stage, so a rerun continues where the last
one stopped. The model code here is the training side of the pair; the test
tests/tools/test_train_tiny_pair.py checks it against vLLM's Qwen3 and DFlashQwen3ForCausalLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from demo import SHIPPED  # the pair in git that scripts/demo.sh serves
from make_tiny_models import qwen3_config, train_tokenizer
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass(frozen=True)
class Shape:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    vocab_size: int = 2048
    target: Shape = Shape()
    drafter: Shape = Shape(num_hidden_layers=2)
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (0, 2)
    rope_theta: float = 1000000.0
    eps: float = 1e-6
    seq_len: int = 256
    batch: int = 16
    target_steps: int = 1200
    target_lr: float = 3e-3
    drafter_steps: int = 1200
    drafter_lr: float = 3e-3
    anchors_per_seq: int = 16
    loss_decay: float = 4.0  # DFlash's gamma: weight of depth k is exp(-(k-1)/gamma)
    num_prompts: int = 64
    prompt_len: int = 64
    checkpoint_every: int = 50
    causal_head: bool = False  # JetSpec: causal in-block attention, forward-KL distillation


HELD_OUT_EVERY = 10  # one file in ten (by path hash) is held out
DEFAULT_OUT = Path.home() / ".cache" / "vllm-ddtree" / "tiny-pair"
DEFAULT_JETSPEC_OUT = Path.home() / ".cache" / "vllm-ddtree" / "tiny-jetspec"


# --- corpus -------------------------------------------------------------------------------

def corpus_split() -> tuple[list[Path], list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(f for f in stdlib.rglob("*.py") if not skip & set(f.relative_to(stdlib).parts))
    held = [f for f in files if _bucket(f.relative_to(stdlib)) == 0]
    return [f for f in files if f not in set(held)], held


def _bucket(rel: Path) -> int:
    return int(hashlib.sha1(str(rel).encode()).hexdigest(), 16) % HELD_OUT_EVERY


def encode_files(tokenizer_dir: Path, files: list[Path], sep: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids: list[int] = []
    for f in files:
        ids += tok(f.read_text(encoding="utf-8", errors="replace"))["input_ids"] + [sep]
    return torch.tensor(ids, dtype=torch.int32)


# --- the models (parameter names are the checkpoints' names) --------------------------------

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of ``x [..., T, heads, head_dim]`` at ``positions [..., T]``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions.float()[..., None] * inv_freq  # [..., T, half]
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, s: Shape, eps: float, theta: float) -> None:
        super().__init__()
        h, d = s.hidden_size, s.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta = (
            s.num_attention_heads, s.num_key_value_heads, d, theta)
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of ``x [N, T, H]``, as ``[N, kv_heads, T, head_dim]``."""
        N, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, T, self.kv_heads, self.head_dim))
        k = rope(k, positions, self.theta)
        v = self.v_proj(x).view(N, T, self.kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``mask`` (True = visible) over ``extra_kv``'s keys then x's own; None = causal."""
        N, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, T, self.heads, self.head_dim))
        q = rope(q, positions, self.theta).transpose(1, 2)
        k, v = self.keys_values(x, positions)
        if extra_kv is not None:
            k, v = torch.cat([extra_kv[0], k], 2), torch.cat([extra_kv[1], v], 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask[:, None],
            is_causal=mask is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(N, T, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape, eps: float, theta: float) -> None:
        super().__init__()
        self.self_attn, self.mlp = SelfAttention(s, eps, theta), MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                extra_kv=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, extra_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Body(nn.Module):
    def __init__(self, r: Recipe, vocab: int) -> None:
        super().__init__()
        s = r.target
        self.embed_tokens = nn.Embedding(vocab, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, r.eps, r.rope_theta)
                                    for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, r.eps)


class Target(nn.Module):
    """Qwen3ForCausalLM: ``model.*`` and ``lm_head``, untied."""

    def __init__(self, r: Recipe, vocab: int) -> None:
        super().__init__()
        self.aux_layers = r.target_layer_ids
        self.model = Qwen3Body(r, vocab)
        self.lm_head = nn.Linear(r.target.hidden_size, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[N, T, V]`` and the drafter's context features ``[N, T, H * len(aux)]``:
        the residual stream after each of ``target_layer_ids``, concatenated."""
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        x, aux = self.model.embed_tokens(ids), []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, None)
            if i in self.aux_layers:
                aux.append(x)
        return self.lm_head(self.model.norm(x)), torch.cat(aux, -1)


class Drafter(nn.Module):
    """The DFlash drafter: ``layers``, ``fc``, ``hidden_norm``, ``norm``; it borrows the
    target's embedding and LM head (frozen, not part of its checkpoint)."""

    def __init__(self, r: Recipe, target: Target) -> None:
        super().__init__()
        s, th = r.drafter, r.target.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(s, r.eps, r.rope_theta)
                                    for _ in range(s.num_hidden_layers))
        self.fc = nn.Linear(th * len(r.target_layer_ids), s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, r.eps)
        self.norm = RMSNorm(s.hidden_size, r.eps)
        self._target = [target]  # a list: not a submodule, so not in this state_dict

    def forward(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                ctx_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, Q, V]`` for query tokens ``block_ids [N, Q]`` at ``block_pos``, given
        context features ``ctx [N, C, H*k]`` at ``ctx_pos [N, C]``; ``mask [N, Q, C + Q]``
        (True = visible) over the context keys then the queries' own keys."""
        target = self._target[0]
        ctx_states = self.hidden_norm(self.fc(ctx))
        x = target.model.embed_tokens(block_ids)
        for layer in self.layers:
            kv = layer.self_attn.keys_values(ctx_states, ctx_pos)
            x = layer(x, block_pos, mask, kv)
        return target.lm_head(self.norm(x))


# --- the block objective --------------------------------------------------------------------

def block_inputs(r: Recipe, anchors: torch.Tensor, seq_len: int, mask_id: int, ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ids, positions and mask for blocks anchored at ``anchors [N, K]`` in sequences
    ``ids [N, T]``: block k is ``[ids[a_k], mask * (block_size - 1)]`` at positions a_k...;
    its queries see the context before a_k (the target has not run the anchor yet) and
    their own block: both ways (DFlash), or, for a JetSpec head, the block's earlier
    queries and themselves."""
    N, K = anchors.shape
    S = r.block_size
    pos = (anchors[..., None] + torch.arange(S)).reshape(N, K * S)
    qids = torch.full((N, K, S), mask_id, dtype=torch.long)
    qids[..., 0] = torch.gather(ids, 1, anchors)
    sees_ctx = torch.arange(seq_len) < anchors.repeat_interleave(S, 1)[..., None]
    block = torch.arange(K).repeat_interleave(S)
    sees_block = block[:, None] == block[None, :]
    if r.causal_head:
        sees_block &= torch.arange(K * S)[:, None] >= torch.arange(K * S)[None, :]
    sees_block = sees_block.expand(N, -1, -1)
    return qids.view(N, K * S), pos, torch.cat([sees_ctx, sees_block], -1)


def drafter_loss(r: Recipe, drafter: Drafter, target: Target, ids: torch.Tensor,
                 anchors: torch.Tensor, mask_id: int) -> torch.Tensor:
    N, T = ids.shape
    with torch.no_grad():
        target_logits, ctx = target(ids)
    qids, qpos, mask = block_inputs(r, anchors, T, mask_id, ids)
    logits = drafter(qids, qpos, ctx, torch.arange(T).expand(N, T), mask)
    S = r.block_size
    logits = logits.view(N, -1, S, logits.shape[-1])[:, :, 1:]  # depth k predicts a + k
    at = (anchors[..., None] + torch.arange(1, S)).view(N, -1)
    if r.causal_head:
        # Forward KL to the target's distribution of token a + k (its logits at a + k - 1);
        # the target's entropy is a constant, so the cross-entropy's gradient is the KL's.
        rows = torch.gather(target_logits, 1, (at - 1)[..., None].expand(
            -1, -1, target_logits.shape[-1]))
        labels = F.softmax(rows.float(), -1).reshape(-1, rows.shape[-1])
    else:
        labels = torch.gather(ids, 1, at).view(-1).long()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels,
                         reduction="none").view(N, -1, S - 1)
    weight = torch.exp(-torch.arange(S - 1) / r.loss_decay)
    return (ce * weight).sum(-1).mean() / weight.sum()


# --- training loop --------------------------------------------------------------------------

def batch_at(r: Recipe, data: torch.Tensor, step: int, stage: int, length: int) -> torch.Tensor:
    """The step's batch of windows: a function of (seed, stage, step), so resuming is exact."""
    g = torch.Generator().manual_seed(r.seed * 1_000_003 + stage * 100_003 + step)
    starts = torch.randint(0, len(data) - length, (r.batch,), generator=g)
    return torch.stack([data[s:s + length] for s in starts.tolist()]).long()


def anchors_at(r: Recipe, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(r.seed * 7_000_003 + step)
    keys = torch.rand(r.batch, r.seq_len - r.block_size, generator=g)
    return keys.argsort(-1)[:, :r.anchors_per_seq].sort(-1).values + 1  # a >= 1: some context


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def train(name: str, r: Recipe, module: nn.Module, steps: int, lr: float, state_path: Path,
          loss_at) -> None:
    from tqdm import tqdm

    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=True)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % r.checkpoint_every == 0 or step + 1 == steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(),
                        "step": step + 1}, tmp)
            tmp.replace(state_path)


def save_target(r: Recipe, target: Target, out: Path, vocab: int, eos: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in target.state_dict().items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = qwen3_config(asdict(r.target), vocab, eos, rope_theta=r.rope_theta,
                          rms_norm_eps=r.eps)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def save_drafter(r: Recipe, drafter: Drafter, out: Path, vocab: int, eos: int, mask_id: int
                 ) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = qwen3_config(
        asdict(r.drafter), vocab, eos, rope_theta=r.rope_theta, rms_norm_eps=r.eps,
        architectures=["DFlashDraftModel"], block_size=r.block_size,
        num_target_layers=r.target.num_hidden_layers,
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": list(r.target_layer_ids),
                       **({"causal_head": True} if r.causal_head else {})})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def special_ids(tokenizer_dir: Path) -> tuple[int, int, int]:
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    return ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|mask|>"]


def run(out: Path, r: Recipe, target_from: Path | None = None) -> None:
    """Train the stages into ``out``; with ``target_from``, its trained target (tokenizer,
    config, weights) is copied and frozen instead of trained."""
    torch.manual_seed(r.seed)
    work = out / "train"
    work.mkdir(parents=True, exist_ok=True)
    recipe = json.loads(json.dumps(asdict(r)))  # as stored: tuples become lists
    if (work / "recipe.json").exists():  # resuming: the checkpoints belong to that recipe
        stored = json.loads((work / "recipe.json").read_text())
        changed = sorted(k for k in recipe if stored.get(k) != recipe[k])
        if changed:
            raise ValueError(f"{out} holds a run with other settings ({', '.join(changed)}); "
                             f"resume it with the same settings, or choose another --out")
    (work / "recipe.json").write_text(json.dumps(recipe, indent=2))
    t0 = time.monotonic()

    train_files, held_files = corpus_split()
    if target_from is not None and not (out / "target" / "tokenizer.json").exists():
        shutil.copytree(target_from, out / "target", dirs_exist_ok=True)
    if not (out / "target" / "tokenizer.json").exists():
        train_tokenizer(out / "target", r.vocab_size, train_files)
    sep, eos, mask_id = special_ids(out / "target")
    data_path = work / "data.pt"
    if not data_path.exists():
        data = {"train": encode_files(out / "target", train_files, sep),
                "held_out": encode_files(out / "target", held_files, sep)}
        torch.save(data, data_path)
    data = torch.load(data_path, weights_only=True)
    tok_vocab = int(max(data["train"].max(), data["held_out"].max(), mask_id)) + 1
    vocab = max(r.vocab_size, (tok_vocab + 63) // 64 * 64)
    print(f"corpus: {len(train_files)} files, {len(data['train'])} tokens for training; "
          f"{len(held_files)} files, {len(data['held_out'])} tokens held out; vocab {vocab}")

    target = Target(r, vocab)
    if target_from is None:
        train("target", r, target, r.target_steps, r.target_lr, work / "target.pt",
              lambda step: _target_loss(target, batch_at(r, data["train"], step, 0,
                                                         r.seq_len + 1)))
        save_target(r, target, out / "target", vocab, eos)
    else:  # shipped in bf16: the same values in float32, as vLLM serves them
        target.load_state_dict({k: v.float() for k, v in
                                load_file(out / "target" / "model.safetensors").items()})
    target.eval().requires_grad_(False)

    drafter = Drafter(r, target)
    train("drafter", r, drafter, r.drafter_steps, r.drafter_lr, work / "drafter.pt",
          lambda step: drafter_loss(r, drafter, target, batch_at(r, data["train"], step, 1,
                                                                 r.seq_len),
                                    anchors_at(r, step), mask_id))
    save_drafter(r, drafter, out / "drafter", vocab, eos, mask_id)

    held = data["held_out"]
    report = evaluate(r, target, drafter, held, mask_id)
    (work / "eval.json").write_text(json.dumps(report, indent=2))
    print("held out: target loss {target_loss:.3f}; drafter top-1 accuracy by depth "
          "{drafter_top1_by_depth}".format(**report))

    g = torch.Generator().manual_seed(r.seed + 1)
    starts = torch.randint(0, len(held) - r.prompt_len, (r.num_prompts,), generator=g)
    prompts = [held[s:s + r.prompt_len].tolist() for s in starts.tolist()]
    (out / "heldout_prompts.json").write_text(json.dumps(prompts))
    print(f"done in {time.monotonic() - t0:.0f} s: {out / 'target'}, {out / 'drafter'}")


@torch.no_grad()
def evaluate(r: Recipe, target: Target, drafter: Drafter, held: torch.Tensor, mask_id: int,
             batches: int = 4) -> dict:
    """Held-out target loss, and the drafter's top-1 accuracy at each depth (the share of
    blocks whose depth-k guess is the next text's token k)."""
    losses, hits = [], torch.zeros(r.block_size - 1)
    for b in range(batches):
        ids = batch_at(r, held, b, 2, r.seq_len + 1)
        losses.append(_target_loss(target, ids).item())
        ids, anchors = ids[:, :-1], anchors_at(r, 10_000_000 + b)
        N, T = ids.shape
        _, ctx = target(ids)
        qids, qpos, mask = block_inputs(r, anchors, T, mask_id, ids)
        logits = drafter(qids, qpos, ctx, torch.arange(T).expand(N, T), mask)
        guess = logits.view(N, -1, r.block_size, logits.shape[-1])[:, :, 1:].argmax(-1)
        labels = torch.gather(ids, 1, (anchors[..., None] + torch.arange(1, r.block_size))
                              .view(N, -1)).view_as(guess)
        hits += (guess == labels).float().mean((0, 1))
    return {"target_loss": sum(losses) / batches,
            "drafter_top1_by_depth": [round(h, 3) for h in (hits / batches).tolist()]}


def _target_loss(target: Target, batch: torch.Tensor) -> torch.Tensor:
    logits, _ = target(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def ship(out: Path, dest: Path, jetspec: bool = False) -> None:
    """Copy the trained pair in ``out`` to ``dest`` with its weights in bfloat16 (half the
    bytes in git; the configs keep float32, so vLLM computes in float32 from the bf16 values)
    and write ``dest/SHA256SUMS`` over every file there, which scripts/demo.sh checks before
    it serves the pair. ``jetspec``: only ``out``'s head, as ``dest/jetspec-drafter``."""
    if jetspec:
        sources = sorted((out / "drafter").iterdir())
        copies = [dest / "jetspec-drafter" / f.name for f in sources]
    else:
        sources = sorted([*(out / "target").iterdir(), *(out / "drafter").iterdir(),
                          out / "heldout_prompts.json"])
        copies = [dest / f.relative_to(out) for f in sources]
    for src, dst in zip(sources, copies):
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.name == "model.safetensors":
            weights = {k: v.to(torch.bfloat16) for k, v in load_file(src).items()}
            save_file(weights, dst, metadata={"format": "pt"})
        else:
            shutil.copyfile(src, dst)
    files = sorted(f for f in dest.rglob("*") if f.is_file() and f.name != "SHA256SUMS")
    (dest / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(dest)}\n" for f in files))
    print(f"shipped: {dest} ({sum(f.stat().st_size for f in files) / 2**20:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--target-steps", type=int, default=Recipe.target_steps)
    parser.add_argument("--drafter-steps", type=int, default=Recipe.drafter_steps)
    parser.add_argument("--jetspec", action="store_true",
                        help="train a JetSpec head for --target instead of a pair (default "
                        "--out: ~/.cache/vllm-ddtree/tiny-jetspec)")
    parser.add_argument("--target", type=Path, default=SHIPPED / "target",
                        help="with --jetspec: the trained target (default: the shipped one)")
    parser.add_argument("--ship", type=Path, nargs="?", const=SHIPPED, default=None,
                        help="then copy the pair, weights in bf16, with SHA256SUMS, to SHIP "
                             f"(default {SHIPPED.relative_to(SHIPPED.parents[1])}: the pair "
                             "scripts/demo.sh serves)")
    args = parser.parse_args()
    out = args.out or (DEFAULT_JETSPEC_OUT if args.jetspec else DEFAULT_OUT)
    run(out, Recipe(seed=args.seed, target_steps=args.target_steps,
                    drafter_steps=args.drafter_steps, causal_head=args.jetspec),
        target_from=args.target if args.jetspec else None)
    if args.ship:
        ship(out, args.ship, jetspec=args.jetspec)


if __name__ == "__main__":
    main()
