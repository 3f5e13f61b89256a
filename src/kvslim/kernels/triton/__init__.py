"""Triton GPU kernels, one module per op family (kernels on top, one plain launcher at the bottom, registered as a
``torch.library`` op): ``quant_decode`` (int8/int4 codes). Nothing here is imported by ``kvslim`` until a call picks
the ``triton`` backend (:mod:`kvslim.kernels.backend`), so the package imports without Triton; with
``TRITON_INTERPRET=1`` set before Triton is imported the kernels also run on CPU tensors (how the tests run them).
"""
