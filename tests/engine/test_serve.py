"""`vllm serve` of the 0.34 stand-in environment, started as users start it (no settings by
hand, the engine in its own process, which loads vllm_ddtree as a plugin by entry point),
answers the `openai` client with the target's own greedy tokens under dflash and under
ddtree, and a bad request gets a 400 while the server keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from engine_runs import REPO
from serving import free_port

from cpu_standin import SETTINGS

# One worker starts each server (module-scoped fixtures are per xdist worker).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]
PAIR = REPO / "models" / "tiny-pair"


SPECS = {
    "dflash": {"method": "dflash", "model": str(PAIR / "drafter"), "num_speculative_tokens": 7},
    "ddtree": {"method": "ddtree", "model": str(PAIR / "drafter"),
               "speculator_options": {"tree_budget": 16}},
}


@contextmanager
def vllm_serve(model: Path, log: Path, *args: str) -> Iterator[str]:
    """`vllm serve model args` as a user starts it; yields its base URL once healthy."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in SETTINGS and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "vllm"), "serve", str(model),
             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
             "--max-model-len", "512", "--enforce-eager", *args],
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
    try:
        yield base
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module", params=sorted(SPECS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with vllm_serve(PAIR / "target", log, "--speculative-config",
                    json.dumps(SPECS[request.param])) as base:
        yield base


def test_openai_client_gets_the_targets_greedy_tokens(server: str) -> None:
    import openai
    from engine_runs import generate

    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    reply = client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=24,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    served = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens] \
        if reply.choices[0].logprobs.tokens[0].startswith("token_id:") else None
    want = generate(str(PAIR / "target"), prompts=["def fibonacci(n):"], max_tokens=24)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    text = tokenizer.decode(want["tokens"][0])
    assert reply.choices[0].text == text, (reply.choices[0].text, text, served)
    assert reply.usage.completion_tokens == 24
    metrics = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and accepted[0] > 0, "no draft accepted"


def test_a_bad_request_is_a_400_and_the_server_keeps_serving(server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="max_tokens|temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=-1)
    again = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0)
    assert again.usage.completion_tokens == 4 or again.choices[0].finish_reason == "stop"
