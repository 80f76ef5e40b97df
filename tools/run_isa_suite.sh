#!/usr/bin/env bash
# Run the numerical tests once per CPU ISA setting that changes which kernels torch picks, each
# with a fresh inductor cache (the cache is keyed without the ISA, so a kernel compiled under one
# setting would otherwise be reused under another and the run would test nothing new).
#
#   tools/run_isa_suite.sh                 # the `numerics` marker (not `slow`): tests/passes/, ...
#   tools/run_isa_suite.sh tests/test_scaler.py -k overflow    # other pytest arguments instead
#
# Settings: ATEN_CPU_CAPABILITY=default|avx2|avx512 (ATen's vectorised kernels) and
# ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's matmul/conv kernels). A setting the CPU lacks falls back to
# the best one it has, so the script runs on any x86 machine. Exit status: 1 if any run failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ "$#" -eq 0 ]; then set -- -m "numerics and not slow"; fi
status=0
for setting in ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx512 \
               ONEDNN_MAX_CPU_ISA=AVX2; do
    cache=$(mktemp -d "${TMPDIR:-/tmp}/dlspass-isa-inductor.XXXXXX")
    echo "== $setting (TORCHINDUCTOR_CACHE_DIR=$cache)"
    env "$setting" TORCHINDUCTOR_CACHE_DIR="$cache" "$PY" -m pytest -q -p no:cacheprovider "$@" \
        || status=1
    rm -rf "$cache"
done
exit $status
