#!/usr/bin/env bash
# The CPU benchmarks' headline numbers on one CUDA GPU, on a randomly initialised Qwen2.5-0.5B-shaped
# student/teacher pair (no download), in under 10 minutes; ends with one table (benchmarks/report.py).
#
#   pip install -e ".[gpu,test,bench]"      # CUDA torch, vllm>=0.32, deepspeed, ray, trl
#   bash benchmarks/gpu_check.sh            # from anywhere; runs in the repo root
#
# Steps, each under `timeout`, with the time it took printed (results: benchmarks/results/gpu/*.json):
#   1. models:            benchmarks/make_random_model.py .cache/gpu-models (skipped when already built);
#   2. engine_throughput: engine actor vs raw vllm.LLM (sampling, teacher scoring, weight sync), both on
#                         the GPU at once, bf16, compiled, the same explicit KV cache on both sides;
#   3. rollout_gateway:   rollout pool + recording gateway vs raw engine generate (one engine on the GPU);
#   4. step_breakdown:    a 4-step Model OPD job on the 0.5B pair (.cache/gpu-models/job.yaml, written here);
#   5. staleness:         the same job with `max_staleness: 0` and `1`, side by side: what overlapping the
#                         next step's rollouts with the learner buys when the roles do not share CPU cores
#                         (runs only if the budget has >= 30 s left; BUDGET_S=900 leaves room for it).
#
# Step 4 shares the one GPU: the job gives student engine, teacher engine and learner 0.3 of it each
# (`resources.*.gpu_fraction`, `learner_gpu_fraction`: Ray reservations and vLLM memory fractions).
# NOT YET RUN ON A GPU: written and checked on CPU only (syntax, flow with a fake nvidia-smi).
#
# Environment: PYTHON (default .venv/bin/python), MODELS_DIR (.cache/gpu-models),
# RESULTS (benchmarks/results/gpu), BUDGET_S (550: all steps together; each step's timeout is the smaller
# of its own cap and what is left, plus 20 s for a stuck process to die after SIGTERM).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-.venv/bin/python}
MODELS_DIR=${MODELS_DIR:-.cache/gpu-models}
RESULTS=${RESULTS:-benchmarks/results/gpu}
BUDGET_S=${BUDGET_S:-550}
START=$SECONDS
export PYTHONUNBUFFERED=1

die() {
    echo "gpu_check: $*" >&2
    exit 2
}

command -v nvidia-smi >/dev/null 2>&1 ||
    die "nvidia-smi not found: this check needs a machine with an NVIDIA GPU and its driver (the CPU benchmarks are \`make bench\`)"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi found but it lists no GPU (driver not loaded?)"
[[ -x $PYTHON ]] || die "no $PYTHON: create the venv and \`pip install -e \".[gpu,test,bench]\"\`"
command -v timeout >/dev/null 2>&1 || die "coreutils \`timeout\` not found"
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') ||
    die "$PYTHON cannot import torch"
((GPUS >= 1)) || die "torch sees no CUDA GPU: is the CPU build of torch installed? (\`pip install -e \".[gpu,test,bench]\"\`)"
echo "gpu_check: $GPUS GPU(s) visible to torch; at start:"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | sed 's/^/  /' || true

mkdir -p "$RESULTS"
# A failed step must show "not run", not an earlier run's numbers.
rm -f "$RESULTS"/engine_throughput.json "$RESULTS"/rollout_gateway.json "$RESULTS"/step_breakdown.json \
    "$RESULTS"/staleness.json

SUMMARY=()
FAILED=0

# Waits (up to 45 s) until the GPUs hold < 2 GiB, so that a step's vLLM does not start while the previous
# step's processes are still exiting (vLLM refuses to start with less free memory than it plans to use).
wait_gpu_free() {
    local used
    for _ in $(seq 45); do
        used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '{s += $1} END {print s + 0}') || return 0
        ((used < 2048)) && return 0
        sleep 1
    done
    echo "   warning: the GPUs still hold ${used} MiB before the next step"
}

# step NAME CAP_S COMMAND...: runs COMMAND under timeout, records its status and elapsed seconds.
step() {
    local name=$1 cap=$2
    shift 2
    [[ $name == models ]] || wait_gpu_free
    local left=$((BUDGET_S - (SECONDS - START)))
    local limit=$((cap < left ? cap : left))
    if ((limit < 30)); then
        echo "== $name: NOT RUN, ${left}s of the ${BUDGET_S}s budget left"
        SUMMARY+=("$(printf '%-18s %6s  %s' "$name" "-" "not run: out of time")")
        FAILED=1
        return 1
    fi
    echo
    echo "== $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc=0
    timeout --kill-after=20 "$limit" "$@" || rc=$?
    local took=$((SECONDS - t0)) status=ok
    if ((rc == 124 || rc == 137)); then
        status="TIMED OUT after ${limit}s"
    elif ((rc != 0)); then
        status="FAILED (exit $rc)"
    fi
    echo "== $name: $status, ${took}s"
    SUMMARY+=("$(printf '%-18s %5ss  %s' "$name" "$took" "$status")")
    if [[ $status != ok ]]; then
        FAILED=1
        echo "   GPU processes still holding memory:"
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | sed 's/^/   /'
        return 1
    fi
}

# 1. models (a --small or otherwise different build in MODELS_DIR is replaced).
if grep -qs '"shape": "qwen2.5-0.5b"' "$MODELS_DIR/manifest.json"; then
    echo "== models: $MODELS_DIR already built, skipped"
    SUMMARY+=("$(printf '%-18s %6s  %s' models "-" "already built")")
elif ! step models 150 "$PYTHON" benchmarks/make_random_model.py "$MODELS_DIR" --force; then
    echo "gpu_check: no models, nothing else can run" >&2
    exit 1
fi

# 2. + 3. one GPU is enough. More prompts/tokens than the CPU defaults: a GPU round must last long
# enough (~1 s) for its timing to mean something.
step engine_throughput 270 "$PYTHON" benchmarks/engine_throughput.py --device cuda \
    --models-dir "$MODELS_DIR" --prompts 200 --max-tokens 128 --rounds 3 \
    --out "$RESULTS/engine_throughput.json" || true
step rollout_gateway 180 "$PYTHON" benchmarks/rollout_gateway.py --device cuda \
    --models-dir "$MODELS_DIR" --prompts 32 --n-rollouts 4 --max-tokens 128 --rounds 3 \
    --out "$RESULTS/rollout_gateway.json" || true

# 4. the OPD step breakdown: student engine, teacher engine and learner share GPU 0 (see top).
JOB=$MODELS_DIR/job.yaml
cat >"$JOB" <<'YAML'
# Written by benchmarks/gpu_check.sh: Model OPD on the random 0.5B pair of benchmarks/make_random_model.py.
# Paths are relative to this file. Student engine, teacher engine and learner share one GPU.
job_name: gpu-check-0.5b-opd
model: student
teacher_model: teacher
training_datasets:
  - data/train.jsonl
hyper_parameters:
  max_steps: 4
  learning_rate: 1.0e-5
  lr_scheduler_type: constant
  batch_size: 8
  n_rollouts: 4
  ppo_mini_batch_size: 32
  max_length: 2048
  max_tokens: 128
  temperature: 1.0
  kl_coef: 1.0
  eval_steps: 1000000
  save_steps: 1000000
  seed: 0
resources:
  learner_gpus: 1
  learner_gpu_fraction: 0.3
  zero_stage: 2
  student:
    dtype: bfloat16
    gpu_fraction: 0.3
  teacher:
    dtype: bfloat16
    gpu_fraction: 0.3
YAML
step step_breakdown 240 "$PYTHON" benchmarks/step_breakdown.py --job "$JOB" --steps 4 \
    --out "$RESULTS/step_breakdown.json" || true

# 5. overlap: max_staleness 0 vs 1 on the same job (two job starts; the last step, so that the headline
# numbers above run first).
step staleness 300 "$PYTHON" benchmarks/staleness.py --job "$JOB" --steps 4 \
    --out "$RESULTS/staleness.json" || true

echo
echo "== elapsed per step (total $((SECONDS - START))s of a ${BUDGET_S}s budget)"
printf '  %s\n' "${SUMMARY[@]}"
echo
"$PYTHON" benchmarks/report.py --results "$RESULTS"
exit "$FAILED"
