#!/usr/bin/env bash
# DDTree in one command: set up, then serve a target through `vllm serve` on 127.0.0.1 alone,
# with vLLM's DFlash chain and with DDTree's adaptive trees (the same drafter), send each the
# same greedy request, print the reply and, side by side, tokens/s, the reply time and the
# tokens each got per target forward.
#
#   scripts/demo.sh                                  # the trained tiny pair (models/tiny-pair), CPU
#   scripts/demo.sh --target DIR --drafter DIR       # real models (on a GPU machine)
#   options: --port N (8000)  --prompt TEXT  --max-tokens N (96)  --budget N (tree nodes, 64)
#            --fixed (a fixed tree budget, not adaptive trees)
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in *" -h "*|*" --help "*) sed -n '2,10p' "$0"; exit 0 ;; esac
bash scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"
