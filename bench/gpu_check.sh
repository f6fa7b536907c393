#!/usr/bin/env bash
# The one-shot GPU check (see bench/gpu.py): trainer steps, Triton delta apply vs the HBM roofline,
# vLLM generation with an in-flight delta and its update stall, the trainer's step at Llama-3-8B's
# shapes (tokens/s, MFU) and the chunked log-prob memory at a 152 k vocabulary, all in one JSON.
#   bench/gpu_check.sh [OUT.json] [extra bench.gpu flags]
# PYTHON: an interpreter with torch (CUDA), triton and vllm (default: python3). Fails fast without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_JSON="${1:-gpu_check.json}"
shift || true
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)' || {
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False); nothing run" >&2
  exit 2
}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the whole check stays under 10 minutes; bench.gpu writes its JSON after every section.
# --llama8b (4 steps of 4 x 2048 tokens) and --logprob-memory run last, each in a child process
# bounded by --child-timeout (240 s); estimated ~1 and ~0.5 min on an H200 (not yet run on one)
exec timeout 570 "$PY" -m bench.gpu --out "$OUT_JSON" --json --llama8b --logprob-memory "$@"
