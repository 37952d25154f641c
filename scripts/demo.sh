#!/usr/bin/env bash
# `make demo`: the real service path on one machine. Starts `opd serve` (API + embedded Ray) on a free
# port with a fresh admin key, creates a tenant key, prints the web console's address, submits the
# example job with `opd submit --follow` (progress bar, final table, curves), then stops the server.
# Usage: bash scripts/demo.sh [JOB_FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
job="${1:-examples/model_opd_tiny/job.yaml}"
data_dir=runs/demo-server
port=$("$bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export OPD_ADMIN_KEY
OPD_ADMIN_KEY=$("$bin/python" -c 'import secrets; print(secrets.token_urlsafe(32))')
export OPD_BASE_URL="http://127.0.0.1:${port}"
# The server takes models only from approved folders (and its tenants' own checkpoints).
export OPD_MODEL_DIRS="[\"$(pwd)/.cache/tiny-models\"]"

mkdir -p "$data_dir"
"$bin/opd" serve --host 127.0.0.1 --port "$port" --data-dir "$data_dir" --log-level warning \
    >"$data_dir/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT

echo "waiting for the job server on ${OPD_BASE_URL} (log: $data_dir/server.log) ..."
"$bin/python" - <<PY
import sys, time, httpx
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        if httpx.get("${OPD_BASE_URL}/readyz", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit("job server did not become ready; see $data_dir/server.log")
PY

export OPD_API_KEY
OPD_API_KEY=$("$bin/opd" keys create --tenant demo | tail -1)
# The web console watches the same job while it trains (the server stops when the job ends).
echo "console: ${OPD_BASE_URL}/console  (sign in with the demo tenant's key: ${OPD_API_KEY})"
"$bin/opd" submit "$job" --follow --plot-dir runs/demo
echo "demo finished in ${SECONDS}s (server start, job, evaluation); server log: $data_dir/server.log"
