"""scripts/demo.sh, the first thing a user runs: with no arguments it serves the shipped trained
tiny pair through `vllm serve` on 127.0.0.1 alone, with the DFlash chain and with ddtree's
adaptive trees, and shows tokens/s, the reply time and tokens per target forward side by side,
the same reply from all three; and the shipped pair is the one its SHA256SUMS names
(scripts/train_tiny_pair.py --ship writes both)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import demo
import pytest
import torch
import train_tiny_pair
from safetensors.torch import load_file, save_file
from serving import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_compares_no_speculation_the_chain_and_adaptive_trees() -> None:
    port = free_port()
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
    result = subprocess.run(["bash", str(REPO / "scripts/demo.sh"), "--port", str(port)],
                            env=env, capture_output=True, text=True, timeout=1200)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]

    reply = re.search(r"^\[demo\] prompt and reply \((\d+) tokens, greedy; ([^)\n]+)\):\n"
                      r"(.*?)\n\[demo\] ---$", result.stdout, re.M | re.S)
    assert reply, out[-3000:]
    assert int(reply.group(1)) == 96
    assert reply.group(2) == "the same reply from all three"  # greedy: the target's own
    text = reply.group(3)
    assert text.startswith(demo.TINY_PROMPT) and len(text) > len(demo.TINY_PROMPT) + 50
    assert all(c.isprintable() or c in "\n\t" for c in text), text  # text, not byte noise

    def row(label: str) -> tuple[float, float, float]:
        m = re.search(rf"^\[demo\] {label}\s+(\S+)\s+(\S+)\s+(\S+)$", result.stdout, re.M)
        assert m, out[-3000:]
        return float(m.group(1)), float(m.group(2)), float(m.group(3))

    assert re.search(r"^\[demo\]\s+none\s+dflash chain\s+ddtree adaptive$", result.stdout,
                     re.M), out[-3000:]
    assert all(rate > 0 for rate in row("tokens/s")), result.stdout
    assert all(seconds > 0 for seconds in row(r"reply time, s")), result.stdout
    none, chain, tree = row(r"tokens per target forward\*")
    assert none == 1.0 and chain > 1 and tree >= 1, result.stdout
    none, chain, tree = row("drafts scheduled per step")
    assert none == 0 and chain == 7 and 0 <= tree <= 64, result.stdout  # the cap

    logs = re.findall(r"\(log: (\S+)\)", result.stdout)
    assert len(logs) == 3 and "vllm-ddtree plugin registered" in Path(logs[2]).read_text()
    with socket.socket() as s:  # the servers are gone: the port is free again
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_the_shipped_pair_matches_its_sums() -> None:
    demo.check_shipped(demo.SHIPPED)  # exits naming each file that differs
    listed = {line.split(maxsplit=1)[1]
              for line in (demo.SHIPPED / "SHA256SUMS").read_text().splitlines()}
    assert {"target/model.safetensors", "drafter/model.safetensors", "target/config.json",
            "target/tokenizer.json", "drafter/config.json"} <= listed
    weights = load_file(demo.SHIPPED / "drafter" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_a_changed_shipped_pair_is_refused(tmp_path: Path) -> None:
    pair = tmp_path / "pair"
    shutil.copytree(demo.SHIPPED, pair)
    weights = pair / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (pair / "target" / "config.json").unlink()
    with pytest.raises(SystemExit) as err:
        demo.check_shipped(pair)
    message = str(err.value)
    assert "drafter/model.safetensors (sha256 differs)" in message
    assert "target/config.json (missing)" in message
    assert "git checkout" in message and "train_tiny_pair.py --seed 0 --ship" in message


def test_ship_writes_bf16_weights_and_their_sums(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    for name in ("target", "drafter"):
        (out / name).mkdir(parents=True)
        save_file({"w": torch.randn(4, 3)}, out / name / "model.safetensors")
        (out / name / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    (out / "heldout_prompts.json").write_text("[[1, 2, 3]]")
    train_tiny_pair.ship(out, dest)
    for name in ("target", "drafter"):
        shipped = load_file(dest / name / "model.safetensors")["w"]
        assert shipped.dtype == torch.bfloat16
        assert torch.equal(shipped, load_file(out / name / "model.safetensors")["w"]
                           .to(torch.bfloat16))
    assert len((dest / "SHA256SUMS").read_text().splitlines()) == 5
    demo.check_shipped(dest)
    (dest / "heldout_prompts.json").write_text("[[1, 2, 4]]")
    with pytest.raises(SystemExit, match=r"heldout_prompts.json \(sha256 differs\)"):
        demo.check_shipped(dest)
