#!/usr/bin/env bash
# The GPU check of issue 32 as one command, inside a device-time budget (default 8 minutes,
# compiles included):
#   tools/bench/gpu_check.sh [budget seconds]
# For GPT, GPT-2 and ResNet-18 in float16 and bfloat16, tools/bench/gpu_profile.py builds torch's
# best practice and dlspass's step once each and reports, side by side: time per bucket (matmul,
# attention, elementwise/fused, optimizer, DLS, copies, host gaps), kernel launches, the attention
# kernels, the unprofiled step time and peak memory, with MISS beside each unmet goal. Jobs, most
# telling first: the launch-bound size (bench_native --small: GPT, where launches and CUDA graphs
# matter), then the large sizes (bench_native --large: GPT, GPT-2, ResNet-18). A job that would
# not finish in what is left of the budget is cut by `timeout` and its table keeps the rows
# written so far (the report is rewritten after each model and format); jobs not started are
# listed as "not measured: budget". Tables: tools/bench/results/gpu_<job>.md.
# PYTHON names the interpreter (default .venv/bin/python, else python3; it must import dlspass,
# e.g. after `pip install --no-deps -e .`). Uses only APIs torch 2.11 and 2.13 both have.
# Exits 2 with a message when torch sees no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
BUDGET=${1:-480}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); nothing measured" >&2
    exit 2
fi
mkdir -p tools/bench/results
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
JOBS=(
    "small-gpt|--small --models gpt"
    "large-gpt|--large --models gpt"
    "large-gpt2|--large --models gpt2"
    "large-resnet18|--large --models resnet18"
)
for job in "${JOBS[@]}"; do
    name=${job%%|*}
    opts=${job#*|}
    left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "gpu_check: $name: not measured: budget (${BUDGET}s) spent"
        continue
    fi
    echo "== $name ($left s left)"
    # shellcheck disable=SC2086 # the options are words
    timeout "$left" "$PY" tools/bench/gpu_profile.py --device cuda $opts --formats bfloat16 float16 \
        --out "tools/bench/results/gpu_$name.md" || echo "gpu_check: $name: stopped (exit $?)"
done
cat tools/bench/results/gpu_*.md 2>/dev/null
