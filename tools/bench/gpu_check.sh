#!/usr/bin/env bash
# The native-precision benchmark on CUDA, float16 and bfloat16, as one command:
#   tools/bench/gpu_check.sh [extra bench_native.py options, e.g. --large, --models gpt, --out F]
# Writes tools/bench/results/native_cuda.md (the table bench_native.py prints; a later --out
# wins). PYTHON names the interpreter (default .venv/bin/python; it must import dlspass, e.g.
# after `pip install --no-deps -e .`). Exits 2 with a message when torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); nothing measured" >&2
    exit 2
fi
mkdir -p tools/bench/results
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
exec "$PY" tools/bench/bench_native.py --device cuda --formats float16 bfloat16 \
    --out tools/bench/results/native_cuda.md "$@"
