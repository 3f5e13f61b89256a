"""Triton GPU kernels, one module per op family (kernels on top, one plain launcher at the bottom)."""
