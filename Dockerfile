# asyncrl: one image for every process (trainer, rollout_worker, scorer, asyncrl tools).
#   docker build -t asyncrl:cpu .                                  # CPU (default)
#   docker build -t asyncrl:cuda --build-arg VARIANT=cuda .        # CUDA + vLLM workers
# Every version comes from pyproject.toml (tests/test_deploy_files.py checks): the CUDA image
# installs the extras a GPU run needs (CUDA_EXTRAS: vLLM, W&B, the agent harnesses), the CPU image
# the CPU torch wheel at the Makefile's pin (which must satisfy pyproject's torch requirement).
# The process is chosen by the command: python -m trainer | rollout_worker | scorer.
ARG VARIANT=cpu

# -- CPU: slim Python, CPU-only torch wheels (an unpinned torch pulls the CUDA ones) ------------
FROM python:3.11-slim-bookworm AS base-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# -- CUDA: runtime image + the GPU extras (vLLM pins its own CUDA torch) -------------------------
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base-cuda
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ARG CUDA_EXTRAS=vllm,agents,wandb
# the extras' requirements exactly as pyproject.toml states them, in a layer of their own (the
# project's code changes more often than vLLM)
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import sys, tomllib; x = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['optional-dependencies']; print('\\n'.join(r for e in sys.argv[1].split(',') for r in x[e]))" "${CUDA_EXTRAS}" > /tmp/extras.txt \
    && pip install -r /tmp/extras.txt

# -- the project, on either base ----------------------------------------------------------------
FROM base-${VARIANT} AS final
ARG VARIANT
ARG CUDA_EXTRAS=vllm,agents,wandb
WORKDIR /opt/asyncrl
COPY pyproject.toml README.md ./
COPY kernel ./kernel
COPY bus ./bus
COPY policy ./policy
COPY delta_codec ./delta_codec
COPY envs ./envs
COPY rollout_worker ./rollout_worker
COPY scorer ./scorer
COPY trainer ./trainer
COPY asyncrl ./asyncrl
COPY bench ./bench
COPY deploy ./deploy
RUN if [ "$VARIANT" = "cuda" ]; then pip install ".[${CUDA_EXTRAS}]"; else pip install .; fi
# delta_codec's numba kernels compiled into the image (else every container compiles them at start)
RUN python -c "import delta_codec; delta_codec.warm()"
# the code sandbox's tools (util-linux: unshare, setpriv; mount): the build fails without them
RUN command -v unshare && command -v setpriv && command -v mount && setpriv --help | grep -q -- --pdeathsig
# unprivileged by default; state (checkpoints, run dirs) lives on a volume. Rollout workers and
# scorers run untrusted code and need root (a fresh uid per sandbox) and namespaces: the compose
# file runs them as user 0 with the security options they need; as uid 10001 they refuse to start
# (envs/isolation.py) unless ASYNCRL_SANDBOX__ALLOW_WEAK_SANDBOX=1 (scorer) or
# ASYNCRL_EPISODES__ALLOW_WEAK_SANDBOX=1 (worker) (docs/environments.md#containment).
RUN useradd --system --create-home --home-dir /var/lib/asyncrl --uid 10001 asyncrl
USER asyncrl
WORKDIR /var/lib/asyncrl
ENV PYTHONUNBUFFERED=1 ASYNCRL_LOG_JSON=1
# SIGTERM drains in-flight work (see docs/operations.md)
STOPSIGNAL SIGTERM
CMD ["asyncrl", "--help"]
