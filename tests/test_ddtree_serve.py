"""`vllm serve` with method "ddtree" given in the dotted CLI form (scripts/demo.sh covers
the JSON form): completions and chat completions, streaming or not, agree; /metrics has the
speculative-decoding counters; a sampling parameter the tree path does not honour gets a
400 naming it, and the server keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serving import free_port, post, streamed_text

# One test worker starts the module's server for every test here (scripts/test.sh).
pytestmark = pytest.mark.xdist_group("ddtree_serve")


@pytest.fixture(scope="module")
def server(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    vllm = str(Path(sys.executable).parent / "vllm")
    with open(log, "w") as out:
        process = subprocess.Popen(
            [vllm, "serve", str(tiny_models / "target"), "--host", "127.0.0.1", "--port",
             str(port), "--served-model-name", "tiny", "--enforce-eager", "--max-model-len",
             "512", "--speculative-config.method", "ddtree", "--speculative-config.model",
             str(tiny_models / "drafter"), "--speculative-config.tree_budget", "8"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            pytest.fail("vllm serve did not come up:\n" + log.read_text()[-4000:])
        time.sleep(1)
    yield base
    process.terminate()
    process.wait(timeout=60)


@pytest.mark.slow
def test_completions_streaming_and_not_agree(server: str) -> None:
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}
    status, plain = post(server, "/v1/completions", body)
    assert status == 200, plain
    text = json.loads(plain)["choices"][0]["text"]
    status, stream = post(server, "/v1/completions", body | {"stream": True})
    assert status == 200 and streamed_text(stream, chat=False) == text and text


@pytest.mark.slow
def test_chat_completions_streaming_and_not_agree(server: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Sort a list."}],
            "max_tokens": 16, "temperature": 0}
    status, plain = post(server, "/v1/chat/completions", body)
    assert status == 200, plain
    text = json.loads(plain)["choices"][0]["message"]["content"]
    status, stream = post(server, "/v1/chat/completions", body | {"stream": True})
    assert status == 200 and streamed_text(stream, chat=True) == text and text


@pytest.mark.slow
def test_sampling_with_seed_is_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "x =", "max_tokens": 12, "temperature": 1.0,
            "top_k": 20, "top_p": 0.9, "seed": 7}
    first, second = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    assert first[0] == second[0] == 200
    assert json.loads(first[1])["choices"][0]["text"] == json.loads(second[1])["choices"][0][
        "text"]


@pytest.mark.slow
@pytest.mark.parametrize("param, value", [
    ("min_p", 0.1), ("logit_bias", {"5": 10}), ("thinking_token_budget", 8),
])
def test_unsupported_parameter_is_a_400_and_the_server_keeps_serving(server: str, param,
                                                                       value) -> None:
    # Sampled: vLLM drops min_p from greedy requests before any check.
    body = {"model": "tiny", "prompt": "x =", "max_tokens": 4, "temperature": 0.7}
    status, payload = post(server, "/v1/completions", body | {param: value})
    assert status == 400, payload
    assert param in payload
    status, payload = post(server, "/v1/completions", body)
    assert status == 200, payload


@pytest.mark.slow
def test_logprobs_are_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
            "logprobs": 2}
    status, payload = post(server, "/v1/completions", body)
    assert status == 200, payload
    logprobs = json.loads(payload)["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    # Greedy: each emitted token is the most probable, so its logprob tops its list.
    for lp, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert abs(lp - max(top.values())) < 1e-5


@pytest.mark.slow
def test_penalties_and_n_are_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "x = x +", "max_tokens": 6, "temperature": 0.8,
            "seed": 3, "n": 2, "repetition_penalty": 1.2, "presence_penalty": 0.3,
            "frequency_penalty": 0.3, "min_tokens": 3, "bad_words": ["x"]}
    status, payload = post(server, "/v1/completions", body)
    assert status == 200, payload
    assert len(json.loads(payload)["choices"]) == 2


@pytest.mark.slow
def test_structured_output_is_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "x =", "max_tokens": 12, "temperature": 0,
            "structured_outputs": {"regex": "[a-z]+"}}
    status, payload = post(server, "/v1/completions", body)
    assert status == 200, payload
    text = json.loads(payload)["choices"][0]["text"]
    assert text.isalpha() and text.islower(), text


@pytest.mark.slow
def test_metrics_show_tree_verification(server: str) -> None:
    post(server, "/v1/completions", {"model": "tiny", "prompt": "for i in", "max_tokens": 8,
                                     "temperature": 0})
    metrics = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    values = {}
    for line in metrics.splitlines():
        for name in ("num_drafts", "num_draft_tokens"):
            if line.startswith(f"vllm:spec_decode_{name}_total"):
                values[name] = values.get(name, 0) + float(line.split()[-1])
    assert values.get("num_drafts", 0) > 0
    assert values["num_draft_tokens"] == 8 * values["num_drafts"]  # tree nodes per step
    # Per-depth acceptance: vLLM's per-position counter, one position per tree depth.
    positions = {line.split('position="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
    assert positions and "0" in positions


@pytest.mark.slow
def test_abort_mid_stream_then_keep_serving(server: str) -> None:
    body = {"model": "tiny", "prompt": "class Tree:", "max_tokens": 24, "temperature": 0}
    status, before = post(server, "/v1/completions", body)
    assert status == 200
    request = urllib.request.Request(
        server + "/v1/completions", json.dumps(body | {"max_tokens": 200, "stream": True})
        .encode(), {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=120)
    for _ in range(4):  # a few streamed chunks, then the client goes away
        response.readline()
    response.close()
    status, after = post(server, "/v1/completions", body)
    assert status == 200
    assert json.loads(after)["choices"][0]["text"] == json.loads(before)["choices"][0]["text"]
