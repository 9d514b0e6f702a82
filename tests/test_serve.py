"""`vllm serve` smoke test on 127.0.0.1, through scripts/demo.sh: builds the tiny pair when
missing, serves it with a speculative drafter, answers a chat request, reports the stats,
and stops the server."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_demo_serves_a_chat_reply(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "VLLM_DDTREE_MODELS": str(tmp_path / "models")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
    result = subprocess.run(["bash", str(REPO / "scripts/demo.sh"), "--port", str(port),
                             "--max-tokens", "24"],
                            env=env, capture_output=True, text=True, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert (tmp_path / "models/drafter/model.safetensors").is_file()  # built when missing
    reply = re.search(r"^\[demo\] reply \((\d+) tokens\): '(.+)'$", result.stdout, re.M)
    assert reply and int(reply.group(1)) == 24 and reply.group(2).strip(), out[-3000:]
    stats = re.search(r"speculative decoding \(ddtree\): (\d+) verify steps, (\d+) tree nodes",
                      result.stdout)
    assert stats and int(stats.group(1)) > 0 and int(stats.group(2)) > 0, out[-3000:]
    log = re.search(r"\(log: (\S+)\)", result.stdout).group(1)
    assert "vllm-ddtree plugin registered" in Path(log).read_text()
    with socket.socket() as s:  # the server is gone: its port is free again
        assert s.connect_ex(("127.0.0.1", port)) != 0
