"""Triton GPU kernels, one module per op family (kernels on top, one plain launcher at the bottom, registered as a
``torch.library`` op): ``quant_decode`` (int8/int4 codes). Nothing here is imported by ``kvslim`` until a call picks
the ``triton`` backend (:mod:`kvslim.kernels.backend`), so the package imports without Triton; with
``TRITON_INTERPRET=1`` set before Triton is imported the kernels also run on CPU tensors (how the tests run them).
"""

import os

_SCALARS_FIXED = False


def interpreter_scalars() -> None:
    """Under ``TRITON_INTERPRET=1`` only: make Triton 3.6's interpreter take a kernel scalar as a loop bound.

    Its scalars are 1-element arrays, and 3.6 turns one into a Python int with ``int(array)``, which NumPy >= 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"): every ``for t0 in range(start, end,
    BLOCK_N)`` whose bounds the kernel computes failed (int4, int2, turbo, slim, encdec, MLA). Triton 3.9 squeezes
    the array first; this gives the interpreter of older Triton releases that same ``__index__`` (issue 42,
    failure 5). Compiled kernels are not touched. Called by every launcher; decided at the first launch (Triton fixes
    its mode when imported), after which a call is one global read."""
    global _SCALARS_FIXED
    if _SCALARS_FIXED:
        return
    _SCALARS_FIXED = True
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "kvslim_scalars", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))  # as Triton 3.9's

    patch_lang_tensor.kvslim_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor
