#!/usr/bin/env bash
# The one command for a lent GPU (issue 33; docs/gpu.md "gpu_check"): run from the checkout's root with the
# machine's own torch, nothing installed. Stages in order, each written as it finishes under $OUT (when set) and
# benchmarks/results/gpu/:  bash scripts/gpu_check.sh --budget 450
#   --quick            every stage's code path on tiny shapes (CPU: the CI test)
#   --stages a,b       a subset of correctness,mha-1b,llama3-8b,encdec-mla,variants
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python python3; do command -v "$c" >/dev/null 2>&1 && { PY="$c"; break; }; done
fi
exec "$PY" -m kvslim.bench.gpucheck "$@"
