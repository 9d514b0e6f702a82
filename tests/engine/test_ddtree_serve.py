"""`vllm serve` with method "ddtree" on V2, given in the dotted CLI form with the documented
top-level tree field (`--speculative-config.tree_budget`, patch 0001): completions and
chat completions, streaming or not, agree; seeded sampling repeats; logprobs, penalties with
n, structured output and tool calls are served (a bad constraint a 400 while a tree request
streams); /metrics counts tree nodes; a client leaving mid-stream
costs the others nothing."""

from __future__ import annotations

import json
import urllib.request

import pytest
from engine_runs import REPO
from serving import post, streamed_text
from test_serve import vllm_serve

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ddtree_serve")]
PAIR = REPO / "models" / "tiny-pair"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with vllm_serve(PAIR / "target", log, "--speculative-config.method", "ddtree",
                    "--speculative-config.model", str(PAIR / "drafter"),
                    "--speculative-config.tree_budget", "8",
                    "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                    # the random-ish tiny target would pad JSON with whitespace forever
                    "--structured-outputs-config", json.dumps(
                        {"backend": "xgrammar", "disable_any_whitespace": True})) as base:
        yield base


def test_completions_streaming_and_not_agree(server: str) -> None:
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}
    status, plain = post(server, "/v1/completions", body)
    assert status == 200, plain
    text = json.loads(plain)["choices"][0]["text"]
    status, stream = post(server, "/v1/completions", body | {"stream": True})
    assert status == 200 and streamed_text(stream, chat=False) == text and text


def test_chat_completions_streaming_and_not_agree(server: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Sort a list."}],
            "max_tokens": 16, "temperature": 0}
    status, plain = post(server, "/v1/chat/completions", body)
    assert status == 200, plain
    text = json.loads(plain)["choices"][0]["message"]["content"]
    status, stream = post(server, "/v1/chat/completions", body | {"stream": True})
    assert status == 200 and streamed_text(stream, chat=True) == text and text


def test_sampling_with_seed_is_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "x =", "max_tokens": 12, "temperature": 1.0,
            "top_k": 20, "top_p": 0.9, "seed": 7}
    first, second = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    assert first[0] == second[0] == 200
    assert json.loads(first[1])["choices"][0]["text"] == json.loads(second[1])["choices"][0][
        "text"]


def test_logprobs_are_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
            "logprobs": 2}
    status, payload = post(server, "/v1/completions", body)
    assert status == 200, payload
    logprobs = json.loads(payload)["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
    # Greedy: each emitted token is the most probable, so its logprob tops its list.
    for lp, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert lp <= 0 and abs(lp - max(top.values())) < 1e-5


def test_penalties_and_n_are_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "x = x +", "max_tokens": 6, "temperature": 0.8,
            "seed": 3, "n": 2, "repetition_penalty": 1.2, "presence_penalty": 0.3,
            "frequency_penalty": 0.3, "min_tokens": 3, "bad_words": ["x"]}
    status, payload = post(server, "/v1/completions", body)
    assert status == 200, payload
    assert len(json.loads(payload)["choices"]) == 2


def test_structured_output_is_served(server: str) -> None:
    body = {"model": "tiny", "prompt": "x =", "max_tokens": 12, "temperature": 0,
            "structured_outputs": {"regex": "[a-z]+"}}
    status, payload = post(server, "/v1/completions", body)
    assert status == 200, payload
    text = json.loads(payload)["choices"][0]["text"]
    assert text.isalpha() and text.islower(), text


TOOL = {"type": "function", "function": {
    "name": "pick", "description": "Picks an operation.",
    "parameters": {"type": "object", "properties": {"op": {"enum": ["add", "sub"]},
                                                    "exact": {"type": "boolean"}},
                   "required": ["op", "exact"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "pick"}}])
def test_tool_calls_are_served(server: str, tool_choice: object) -> None:
    """tool_choice "required" or a named tool: vLLM's serving layer constrains the reply
    by the tools' JSON schema, and the tree steps give a parsed call."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Add 2 and 3."}],
            "tools": [TOOL], "tool_choice": tool_choice, "parallel_tool_calls": False,
            "max_tokens": 96, "temperature": 0}
    status, payload = post(server, "/v1/chat/completions", body)
    assert status == 200, payload
    calls = json.loads(payload)["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "pick", calls
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert arguments["op"] in ("add", "sub") and isinstance(arguments["exact"], bool)


def test_a_bad_constraint_gets_a_400_while_a_tree_request_streams(server: str) -> None:
    """An invalid regex, JSON schema or grammar is refused with a 400 naming it while a
    constrained tree request is in flight, which then ends as it does alone."""
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 48, "temperature": 0,
            "structured_outputs": {"regex": r"(\n    [a-z_]+ = [0-9]+)+"}}
    status, alone = post(server, "/v1/completions", body)
    assert status == 200, alone
    request = urllib.request.Request(
        server + "/v1/completions", json.dumps(body | {"stream": True}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        streamed = response.readline().decode()  # in flight
        for bad, named in (({"regex": "(unclosed"}, "regex"),
                           ({"json": {"type": "object", "properties": 5}}, "properties"),
                           ({"grammar": "root ::= ("}, "grammar")):
            status, payload = post(server, "/v1/completions",
                                   {"model": "tiny", "prompt": "x =", "max_tokens": 4,
                                    "structured_outputs": bad})
            assert status == 400 and named in payload.lower(), (bad, status, payload)
        streamed += response.read().decode()
    assert streamed_text(streamed, chat=False) == json.loads(alone)["choices"][0]["text"]


def test_metrics_show_tree_verification(server: str) -> None:
    def counted() -> dict[str, float]:
        metrics = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
        values: dict[str, float] = {}
        for line in metrics.splitlines():
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                if line.startswith(f"vllm:spec_decode_{name}_total"):
                    values[name] = values.get(name, 0) + float(line.split()[-1])
        return values

    before = counted()
    post(server, "/v1/completions", {"model": "tiny", "prompt": "for i in", "max_tokens": 8,
                                     "temperature": 0})
    values = {k: v - before.get(k, 0) for k, v in counted().items()}
    assert values.get("num_drafts", 0) > 0 and values.get("num_accepted_tokens", 0) > 0
    # Tree nodes per step: 8, fewer where the scheduler cuts a tree near a request's end
    # (V2 schedules no drafts past max_tokens).
    assert 6 * values["num_drafts"] < values["num_draft_tokens"] <= 8 * values["num_drafts"]


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
