#!/usr/bin/env bash
# The GPU machine's Python environment, replicated on a CPU, and gpu_check's code run in it (issue 42; docs/gpu.md
# "Replica of the GPU machine's environment"). CI runs it after the suite (.ci/run).
#
# Makes once a virtualenv OUTSIDE the checkout, keyed by the pins below and the interpreter's version
# (${KVSLIM_GPU_ENV_DIR:-~/.cache/kvslim/gpu-env-<hash>}): Python 3.12, torch 2.11.0 (the registry's wheel is the CUDA
# 13 build, ~3.8 GB with its CUDA packages; it imports without a GPU), triton 3.6.0, transformers 5.17.0, and of the
# other packages the GPU machine has only those the check and its tests import. kvslim is NOT installed: src/ goes
# on PYTHONPATH, as on the GPU machine. The project's .venv is never read or written.
# Then, in that environment (each stage's output in $KVSLIM_GPU_ENV_LOGS, default a temporary folder):
#   1. gpu-check   python -m kvslim.bench.gpucheck --quick --all-kinds --device cpu: every stage on tiny shapes,
#                  every stage-2 kind compiled in the full check's compile mode, stage 1's pytest groups;
#   2. compile     the compile and capture test files (test_cuda_graphs, test_capturable_*, test_sync_free,
#                  test_triton_capturable, test_torch_floor) on CPU;
#   3. stage1      stage 1's Triton test files through Triton's interpreter (TRITON_INTERPRET=1; -k "not sm90" as
#                  stage 1 selects), the CUDA-only tests skipped with their reason.
# Exit status: 0 when every stage passed; 1 when one failed (each failing stage named with its error); 2 when the
# environment could not be made (no Python 3.12, a pin the registry does not have: named).
#   bash scripts/gpu_env.sh [--setup-only] [--stages gpu-check,compile,stage1]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD

# the GPU machine's versions (issue 42) and, of what else it has, what gpu_check and the tests it runs import
PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 pytest==9.2.0 pytest-xdist==3.8.0 hypothesis==6.170.17)
STAGES=gpu-check,compile,stage1
SETUP_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --setup-only) SETUP_ONLY=1 ;;
    --stages) shift; STAGES=${1:-} ;;
    *) echo "gpu_env.sh: unknown argument $1 (--setup-only, --stages gpu-check,compile,stage1)" >&2; exit 2 ;;
  esac
  shift
done

say() { echo "gpu_env.sh: $*"; }

outside() {  # the replica lives outside the checkout: never in (or over) the project's .venv
  # as given and with its links resolved: a path inside the checkout that links elsewhere (a .venv symlinked from
  # another checkout) is refused too, else the environment would replace what it links to
  local p
  for p in "$(realpath -s -m "$1")" "$(realpath -m "$1")"; do
    case "$p/" in
      "$ROOT"/* | "$(realpath -m "$ROOT")"/*) say "refusing $1: the replica's virtualenv must lie outside the checkout (never its .venv); set" \
                     "KVSLIM_GPU_ENV_DIR elsewhere" >&2
                 exit 2 ;;
    esac
  done
}
[ -n "${KVSLIM_GPU_ENV_DIR:-}" ] && outside "$KVSLIM_GPU_ENV_DIR"

# -- Python 3.12 -------------------------------------------------------------------------------------------------
find_python() {
  local c
  for c in "${KVSLIM_GPU_PYTHON:-}" python3.12 "${PYENV_ROOT:-${HOME:-/root}/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}
PY312=$(find_python) || {
  say "Python 3.12 not found (the GPU machine runs 3.12): tried \$KVSLIM_GPU_PYTHON, python3.12 on PATH and" \
      "pyenv's versions/3.12*; install one (pyenv install 3.12) or set KVSLIM_GPU_PYTHON=/path/to/python3.12" >&2
  exit 2
}
PYVER=$("$PY312" -c 'import platform; print(platform.python_version())')
HASH=$(printf '%s\n' "$PYVER" "${PINS[@]}" | sha256sum | cut -c1-12)
ENV_DIR=${KVSLIM_GPU_ENV_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/kvslim/gpu-env-$HASH}
ENV_DIR=$(realpath -m "$ENV_DIR")
PY="$ENV_DIR/bin/python"

# -- the environment, once (one maker at a time: a second run waits on the lock, then finds it made) ---------------
mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"
flock 9
if [ -f "$ENV_DIR/.kvslim-pins" ] && [ "$(cat "$ENV_DIR/.kvslim-pins")" = "$(printf '%s\n' "$PYVER" "${PINS[@]}")" ] \
   && "$PY" -c 'import torch, triton, transformers, pytest' 2>/dev/null; then
  say "environment $ENV_DIR (cached; Python $PYVER, ${PINS[*]})"
else
  say "making $ENV_DIR (Python $PYVER from $PY312; ${PINS[*]}): ~3.8 GB, a few minutes"
  t0=$SECONDS
  rm -rf "$ENV_DIR"
  mkdir -p "$(dirname "$ENV_DIR")"
  "$PY312" -m venv "$ENV_DIR" || { say "python -m venv failed for $PY312" >&2; exit 2; }
  log="$ENV_DIR/.install.log"
  if ! "$PY" -m pip install --progress-bar off "${PINS[@]}" >"$log" 2>&1; then
    grep -E '^ERROR' "$log" | cut -c1-300 >&2
    # which pin the registry did not have: ask for each one's versions (a look-up, nothing downloaded)
    for pin in "${PINS[@]}"; do
      name=${pin%%==*} want=${pin#*==}
      have=$("$PY" -m pip index versions "$name" 2>/dev/null | sed -n 's/^Available versions: //p')
      if ! printf '%s' ", $have," | grep -q ", $want,"; then
        say "the package registry has no $name==$want for Python $PYVER (newest it offers:" \
            "$(printf '%s' "${have:-nothing}" | cut -d, -f1-6))" >&2
      fi
    done
    say "pip install failed (log: $log)" >&2
    exit 2
  fi
  printf '%s\n' "$PYVER" "${PINS[@]}" > "$ENV_DIR/.kvslim-pins"
  say "made in $((SECONDS - t0)) s ($(du -sh "$ENV_DIR" | cut -f1))"
fi
flock -u 9
"$PY" -c 'import torch, triton, transformers; print("gpu_env.sh: torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)'
[ "$SETUP_ONLY" = 1 ] && exit 0

# -- the stages ----------------------------------------------------------------------------------------------------
LOGS=${KVSLIM_GPU_ENV_LOGS:-$(mktemp -d -t kvslim-gpu-env.XXXXXX)}
mkdir -p "$LOGS"
# src on PYTHONPATH, nothing installed (as on the GPU machine); no project-set backend or interpreter leaks in
export PYTHONPATH="$ROOT/src"
unset KVSLIM_BACKEND TRITON_INTERPRET VIRTUAL_ENV
# the C++ ops take CPU tensors only and are the suite's (torch 2.13) business; built for this torch they would cost
# minutes of compiles; without them CPU steps run the twins, as on a GPU host with no C++ toolchain (failure 4)
export KVSLIM_NO_KERNELS=${KVSLIM_NO_KERNELS:-1}
# the compile and capture files (stage 1's CUDA-only tests skip in them with their reason)
COMPILE_FILES=(tests/test_cuda_graphs.py tests/test_capturable.py tests/test_capturable_all.py
               tests/test_capturable_mla.py tests/test_capturable_residual.py tests/test_capturable_ring.py
               tests/test_capturable_slim.py tests/test_capturable_turbo.py tests/test_sync_free.py
               tests/test_triton_capturable.py tests/test_torch_floor.py tests/test_sparse_capturable.py)
STAGE1_FILES=$("$PY" -c 'from kvslim.bench.gpucheck_stages import PYTEST_GROUPS as G
print(" ".join(sorted({n.split("::")[0] for _, ns in G for n in ns if "triton" in n})))')
failed=()
stage() {  # name, command...: run, time, and on failure keep the error lines
  local name=$1
  shift
  case ",$STAGES," in *",$name,"*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  say "== $name: $*"
  "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -3 "$LOGS/$name.log" | sed "s/^/  $name | /"
  if [ $rc -ne 0 ]; then
    failed+=("$name")
    say "== $name FAILED (exit $rc, $((SECONDS - t0)) s); its errors:"
    grep -E '^(FAILED|ERROR)|Error|error:|\| (failed|error) ' "$LOGS/$name.log" | head -40 | sed "s/^/  $name | /"
  else
    say "== $name ok ($((SECONDS - t0)) s)"
  fi
}
gpu_check() {  # the index says ok per stage; a stage that failed makes the exit status non-zero
  "$PY" -m kvslim.bench.gpucheck --quick --all-kinds --device cpu --budget 3600 --out "$LOGS/gpu_check" || return 1
  "$PY" - "$LOGS/gpu_check/gpu_check.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
bad = [s for s in doc["stages"] if s["status"] != "ok"]
for s in bad:
    print(f"gpu_check stage {s['stage']}: {s['status']}: {s.get('error') or s.get('failed') or s.get('failed_tests')}")
rows = [r for r in json.load(open(sys.argv[1].replace(".json", "_mha-1b.json")))["records"] if "+compiled" in r["kind"]]
print("compiled rows (graphs):", ", ".join(f"{r['kind']}={(r.get('compile_counts') or {}).get('unique_graphs')}"
                                           f"{' ERROR ' + r['error'] if 'error' in r else ''}" for r in rows))
sys.exit(1 if bad else 0)
EOF
}
# -n 2: two workers (the shared 2-core machine); --dist loadfile keeps a file's compiles in one process
stage gpu-check gpu_check
stage compile "$PY" -m pytest -p no:cacheprovider -n 2 --dist loadfile -rfEs "${COMPILE_FILES[@]}"
# shellcheck disable=SC2086  # the file list is word-split on purpose
stage stage1 env TRITON_INTERPRET=1 "$PY" -m pytest -p no:cacheprovider -n 2 --dist loadfile -rfE -k "not sm90" $STAGE1_FILES
say "logs in $LOGS"
if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED stages: ${failed[*]}"
  exit 1
fi
say "every stage passed"
