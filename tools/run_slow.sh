#!/usr/bin/env bash
# Run the tests behind the `slow` marker (deselected by the README's test command): long
# compiles and subprocess runs that check the same behaviour at larger sizes or in more
# directions than their default-suite counterparts (hundreds of cases: narrow it with arguments).
#
#   tools/run_slow.sh                      # every slow case
#   tools/run_slow.sh tests/test_cache_facts.py     # other pytest arguments narrow it
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m pytest -q -p no:cacheprovider -m slow "$@"
