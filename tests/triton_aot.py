"""Compile Triton kernels to sm_90 cubins without a GPU (Triton's bundled ptxas), in a subprocess that runs with
Triton's compiler, not its interpreter: code that only the compiler rejects (types, layouts, constexpr branches) then
fails a CPU test. Each family's test passes a script that calls ``build`` for its kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

PRELUDE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, types, const, warps, stages=None):
    """``types``: argument name -> Triton type ("*fp32", "i64", ...); arguments not named are "i32"."""
    sig = {name: name in const and "constexpr" or types.get(name, "i32") for name in fn.arg_names}
    options = {"num_warps": warps, **({} if stages is None else {"num_stages": stages})}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=options)
    assert k.asm.get("cubin"), fn
'''


def compile_for_sm90(script: str) -> None:
    """Run ``PRELUDE + script`` in a subprocess; it must print "compiled". Skips when this Triton has no NVIDIA
    backend or no ptxas."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = PRELUDE + script + '\nprint("compiled", triton.__version__)\n'
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip("no ptxas bundled with this Triton")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


def kernel_device(cuda_only: bool = False) -> torch.device:
    """The device of every test that gpu_check's stage 1 selects (issue 42; through the ``kernel_dev`` / ``cuda_dev``
    fixtures of tests/conftest.py, or a module's ``DEVICE``): a CUDA device when there is one and Triton is not
    interpreting; CPU tensors only under ``TRITON_INTERPRET=1`` (CI); otherwise the test (or the calling module) is
    skipped with a reason, never run on CPU tensors. ``cuda_only``: a test that needs CUDA itself (CUDA graphs, the
    sync debug mode): CUDA or a skip.

    Under the interpreter it also checks that Triton was imported after ``TRITON_INTERPRET=1`` was set
    (tests/conftest.py sets it first): imported before, Triton's own helpers (``tl.zeros``, ``tl.sum``) stay
    compiled-only and an interpreted kernel fails to call them."""
    from kvslim.kernels import backend

    if cuda_only:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device (CUDA graphs / sync debug mode; the CPU tests trace the same steps)",
                        allow_module_level=True)
        return torch.device("cuda")
    if backend.interpreting():
        import triton
        from triton.runtime.jit import JITFunction

        assert not isinstance(triton.language.zeros, JITFunction), (
            "triton was imported before TRITON_INTERPRET=1 was set: set it in the environment (tests/conftest.py)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device: the Triton kernels cannot run here", allow_module_level=True)
    return torch.device("cuda")


def assert_page_list(launch, dispatch, args: tuple, pages: torch.Tensor, page: int, ref: torch.Tensor,
                     ref_lse: torch.Tensor, stored_pages: int | None = None) -> None:
    """A Triton launcher with a page list (forced 1 and 3 splits) and the family's dispatch under
    ``KVSLIM_BACKEND=triton`` equal the twin's ``(ref, ref_lse)`` over the gathered rows; a page list too short for
    ``n``, a float one and a page size that is no power of two are refused by name. ``args``: the launcher's
    positional arguments, on the kernels' device."""
    from tolerances import assert_close

    listed = pages.to(args[0].device)
    for splits in (1, 3):
        out, lse = launch(*args, splits=splits, pages=listed, page=page)
        assert_close(out.cpu(), ref, torch.float32, f"paged kernel vs twin (splits={splits})")
        assert_close(lse.cpu(), ref_lse, torch.float32, f"paged kernel lse (splits={splits})")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSLIM_BACKEND", "triton")
        out, _ = dispatch(*args, pages=listed, page=page)
    assert_close(out.cpu(), ref, torch.float32, "dispatch with a page list")
    if stored_pages is not None:  # ids outside the buffers' pages read the nearest page, never outside memory
        assert_ids_clamped(lambda ids, s: launch(*args, splits=s, pages=ids, page=page), listed, stored_pages)
    with pytest.raises(ValueError, match="pages must be"):
        launch(*args, pages=listed[:, :, :2], page=page)
    with pytest.raises(ValueError, match="pages must be"):
        launch(*args, pages=listed.float(), page=page)
    with pytest.raises(ValueError, match="page must be a power of two"):
        launch(*args, pages=listed, page=page + 1)


def assert_ids_clamped(run, listed: torch.Tensor, stored_pages: int) -> None:
    """``run(ids, splits)`` with page ids below 0 and past the ``stored_pages`` the buffers hold equals ``run`` with
    those ids clamped into [0, stored_pages): the kernels keep every read in bounds without checking the list on the
    host (a device sync)."""
    wild = listed.clone()
    wild[0, 0, 0] = -7
    wild[-1, -1, 1] = stored_pages + 100
    tame = wild.clamp(0, stored_pages - 1)
    for splits in (1, 3):
        got, want = run(wild, splits), run(tame, splits)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b.cpu()), f"out-of-range page ids (splits={splits})"
