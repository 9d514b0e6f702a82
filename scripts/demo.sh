#!/usr/bin/env bash
# The main job: serve a target with DDTree (a DFlash drafter's token tree, verified by the
# target in one forward) through `vllm serve` on 127.0.0.1,
# send one chat request, print the reply and the speculative decoding stats, stop the server.
#
#   scripts/demo.sh                                  # the tiny pair on CPU (built if missing)
#   scripts/demo.sh --target DIR --drafter DIR       # real models (on a GPU machine)
#   options: --port N (8000)  --prompt TEXT  --max-tokens N (64)  --budget N (tree nodes, 16)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODELS=${VLLM_DDTREE_MODELS:-$REPO/models/tiny}
TARGET="" DRAFTER="" PORT=8000 MAX_TOKENS=64 BUDGET=16
PROMPT="Write a Python function that reverses a list."
while [ $# -gt 0 ]; do
  case "$1" in
    --target) TARGET=$2; shift 2 ;;
    --drafter) DRAFTER=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --prompt) PROMPT=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

bash scripts/setup_env.sh
PY=$REPO/.venv/bin/python
EXTRA=()
if [ -z "$TARGET" ]; then
  [ -f "$MODELS/drafter/model.safetensors" ] || "$PY" scripts/make_tiny_models.py --out "$MODELS"
  TARGET=$MODELS/target DRAFTER=${DRAFTER:-$MODELS/drafter}
fi
[ -n "$DRAFTER" ] || { echo "demo.sh: --target needs --drafter" >&2; exit 2; }
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  EXTRA+=(--enforce-eager --max-model-len 1024)
fi
SPEC="{\"method\": \"ddtree\", \"model\": \"$DRAFTER\", \"tree_budget\": $BUDGET}"

LOG=$(mktemp /tmp/vllm-ddtree-demo.XXXXXX.log)
echo "[demo] vllm serve $TARGET --speculative-config '$SPEC' (log: $LOG)"
"$REPO/.venv/bin/vllm" serve "$TARGET" --host 127.0.0.1 --port "$PORT" \
  --served-model-name demo --speculative-config "$SPEC" "${EXTRA[@]}" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT

"$PY" - "$PORT" "$PROMPT" "$MAX_TOKENS" "$SERVER" "$LOG" <<'PYEOF'
import json, os, re, sys, time, urllib.request

port, prompt, max_tokens, server, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
base = f"http://127.0.0.1:{port}"
deadline = time.time() + 600
while True:
    try:
        if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
            break
    except OSError:
        pass
    alive = os.path.exists(f"/proc/{server}") and "zombie" not in open(f"/proc/{server}/status").read()
    if not alive or time.time() > deadline:
        sys.stdout.write(open(log).read()[-4000:])
        sys.exit("[demo] the server did not come up")
    time.sleep(1)
body = {"model": "demo", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0}
req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=300))
print(f"[demo] prompt: {prompt}")
print(f"[demo] reply ({reply['usage']['completion_tokens']} tokens): "
      f"{reply['choices'][0]['message']['content']!r}")
metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
def total(name):
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))
drafts, drafted, accepted = (total(f"vllm:spec_decode_num_{n}_total")
                             for n in ("drafts", "draft_tokens", "accepted_tokens"))
print(f"[demo] speculative decoding (ddtree): {drafts:.0f} verify steps, {drafted:.0f} tree "
      f"nodes drafted, {accepted:.0f} accepted, mean acceptance length "
      f"{(1 + accepted / drafts) if drafts else float('nan'):.2f} tokens per target forward")
PYEOF
