#!/usr/bin/env bash
# DDTree's gain in one command: set up, then serve a target through `vllm serve` on 127.0.0.1
# with DDTree and with vLLM's DFlash chain (the same drafter), send both the same greedy
# request, print the reply and, side by side, the tokens each got per target forward.
#
#   scripts/demo.sh                                  # the trained tiny pair (models/tiny-pair), CPU
#   scripts/demo.sh --target DIR --drafter DIR       # real models (on a GPU machine)
#   options: --port N (8000)  --prompt TEXT  --max-tokens N (96)  --budget N (tree nodes, 64)
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in *" -h "*|*" --help "*) sed -n '2,8p' "$0"; exit 0 ;; esac
bash scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"
