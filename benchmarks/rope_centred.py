"""Bench-only: turbo keys centred by their *rotated* pre-RoPE channel means, the residual coded post-RoPE.

``prerope_keys=True`` codes keys before RoPE: the best quality (docs/quantization.md §10.1), but a fused decode
cannot move the query into one coded basis (RoPE differs per row). This variant keeps only the pre-RoPE *centring*:
the channel means μ of the first write are fitted before RoPE, a row at slot s is coded as ``k − RoPE_s(μ)`` after
RoPE (outlier channels and rotations as turbo3's), and decoded as ``k̂ = RoPE_s(μ) + residual``. A fused op would then
need only a per-row score bias ``q·RoPE_s(μ)`` beside the codes it reads today. :func:`patch` swaps the turbo store's
write/read for key stores planned with ``prerope_keys=True`` (``spec.rope``), for one benchmark process
(``bench_quality.py --rope-centred``), to measure whether that variant keeps pre-RoPE's quality.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvslim.caches.storage import check_finite
from kvslim.caches.turbo import TurboStore
from kvslim.ops.rope import rotate


def _rope_mean(store: TurboStore, start: int, end: int) -> torch.Tensor:
    return rotate(store.rmean.expand(*store.rmean.shape[:2], end - start, store.rmean.shape[-1]),
                  *store._rope_table(start, end))


def _write(self: TurboStore, start: int, x: torch.Tensor, *, checked: bool = False) -> None:
    if self.spec.rope is None:
        return _ORIGINAL["write"](self, start, x, checked=checked)
    if not checked:
        check_finite(x, self)
    if getattr(self, "rmean", None) is None:
        self.rmean = self._unrope(start, x).float().mean(dim=2, keepdim=True)
        self.spec = replace(self.spec, center=False)  # the store's own centring off: the residual is centred
    r = x.float() - _rope_mean(self, start, start + x.shape[2])
    inv, self._inv_freq = self._inv_freq, None  # code the post-RoPE residual (no un-rotation)
    try:
        self._fit(r)
        codes, scale = self._encode(r)
    finally:
        self._inv_freq = inv
    self.data[:, :, start:start + x.shape[2]] = codes
    self.scale[:, :, start:start + x.shape[2]] = scale


def _read(self: TurboStore, start: int, end: int, scratch=None) -> torch.Tensor:
    if self.spec.rope is None or getattr(self, "rmean", None) is None:
        return _ORIGINAL["read"](self, start, end, scratch)
    out = self._decode(self.data[:, :, start:end], self.scale[:, :, start:end]).float()
    return (out + _rope_mean(self, start, end)).to(self.dtype)


def _fixed(self: TurboStore) -> int:
    extra = getattr(self, "rmean", None)
    return _ORIGINAL["fixed"](self) + (0 if extra is None else extra.numel() * extra.element_size())


_ORIGINAL: dict = {}


def patch() -> None:
    """Swap in the variant for every turbo store with ``spec.rope`` in this process."""
    if _ORIGINAL:
        return
    _ORIGINAL.update(write=TurboStore.write, read=TurboStore.read, fixed=TurboStore._fixed_nbytes)
    TurboStore.write, TurboStore.read, TurboStore._fixed_nbytes = _write, _read, _fixed


def main() -> None:
    """Self-check on synthetic keys (a constant pre-RoPE part per head plus noise): relative error of the rows read
    back, post-RoPE coding, pre-RoPE coding, and this variant."""
    import argparse
    import sys
    from pathlib import Path

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import tiny_model

    from kvslim.caches import make_store
    from kvslim.methods import METHODS

    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, kv_heads=2)
    spec = replace(METHODS["turbo3"].plan_model(model, prerope_keys=True).layers[0].factory(None).spec, residual=0,
                   sink=0, flush=1)
    g = torch.Generator().manual_seed(0)
    pre = 5 * torch.randn(1, 2, 1, 64, generator=g) + torch.randn(1, 2, 300, 64, generator=g)
    f = torch.arange(300).float()[:, None] * torch.tensor(spec.rope)[None]
    post = rotate(pre, torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin())
    for name, s in (("post-RoPE codes", replace(spec, rope=None)), ("pre-RoPE codes", spec)):
        st = make_store(s, post, 320)
        st.write(0, post[:, :, :200])
        st.write(200, post[:, :, 200:])
        print(f"{name:28s} rel. error {((st.read(0, 300) - post).pow(2).sum() / post.pow(2).sum()).item():.5f}")
    patch()
    st = make_store(spec, post, 320)
    st.write(0, post[:, :, :200])
    st.write(200, post[:, :, 200:])
    print(f"{'RoPE-centred (this variant)':28s} rel. error {((st.read(0, 300) - post).pow(2).sum() / post.pow(2).sum()).item():.5f}")


if __name__ == "__main__":
    main()
