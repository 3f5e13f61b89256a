"""Float64 weight algebra for slim attention (SPEC §3), done once at conversion time.

Row-vector convention: ``k = x W_K + b_K`` with ``W_K`` of shape (d, e). Every map here solves a linear
system with ``torch.linalg.solve`` (square) or ``torch.linalg.lstsq`` (min-norm / weighted), never ``inv``.

* :func:`reconstruction_map` — ``M`` with ``W_src M = W_dst`` (e.g. ``W_KV = W_K⁻¹ W_V``; the right inverse
  ``W_K^T (W_K W_K^T)⁻¹ W_V`` for e > d), optionally the minimum-noise solution for per-column scales.
* :func:`conditioned_basis` — the r extra directions ``P`` (d, r) of the conditioned K-cache: the stored
  coordinates ``z = x P`` cover the input directions that ``W_K`` represents worst.
"""

from __future__ import annotations

import torch

F64 = torch.float64


def _64(w: torch.Tensor) -> torch.Tensor:
    return w.detach().to(device="cpu", dtype=F64)


def cond(w: torch.Tensor) -> float:
    """2-norm condition number ``σ_max / σ_min`` of ``w`` (inf when rank-deficient)."""
    s = torch.linalg.svd(_64(w), full_matrices=False).S  # (svdvals takes a much slower LAPACK path here)
    return float("inf") if s[-1] == 0 else float(s[0] / s[-1])


def reconstruction_map(w_src: torch.Tensor, w_dst: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``M`` (c, e) with ``w_src M = w_dst``: the map from a stored projection to a rebuilt one.

    Args:
        w_src: (d, c) projection whose output is stored (``W_K``, or ``[W_K, P]`` for the conditioned cache).
        w_dst: (d, e) projection to rebuild (``W_V``).
        scale: optional (c,) typical magnitude of each stored column. Rounding noise of a stored value is
            proportional to its magnitude, so among all exact solutions the one minimizing
            ``‖diag(scale) M‖_F`` amplifies storage rounding least.

    Returns:
        float64 (c, e). Square and unscaled: ``solve(w_src, w_dst)``; otherwise the (weighted) minimum-norm
        least-squares solution, which for c > d is the right inverse ``w_src^T (w_src w_src^T)⁻¹ w_dst``.

    Raises:
        ValueError: if ``w_src`` cannot reproduce ``w_dst`` (c < d: the stored projection lost information).
    """
    a, b = _64(w_src), _64(w_dst)
    d, c = a.shape
    if c < d:
        raise ValueError(f"stored width {c} < model width {d}: the input cannot be rebuilt (GQA/MQA-like shape)")
    if scale is None and c == d:
        return torch.linalg.solve(a, b)
    s = torch.ones(c, dtype=F64) if scale is None else _64(scale).clamp_min(1e-30)
    return min_norm_solve(a / s, b) / s[:, None]  # y = diag(s) M has the least norm


def min_norm_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Least-norm ``x`` with ``a x = b`` for a wide full-row-rank ``a`` (d, c ≥ d): QR of ``a^T``, no normal
    equations; falls back to LAPACK ``gelsd`` when ``a`` is rank-deficient."""
    q, r = torch.linalg.qr(a.T)  # a^T = Q R, so a = R^T Q^T and x = Q R^{-T} b
    diag = r.diagonal().abs()
    if diag.min() > 1e-13 * diag.max():
        return q @ torch.linalg.solve_triangular(r.T, b, upper=False)
    return torch.linalg.lstsq(a, b, driver="gelsd").solution


def activation_stats(x: torch.Tensor) -> torch.Tensor:
    """Uncentered second moment ``X^T X / N`` (d, d) of activations ``x`` (N, d), float64."""
    x = _64(x).reshape(-1, x.shape[-1])
    return x.T @ x / max(1, x.shape[0])


def column_rms(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Root-mean-square of each output column of ``x W + b`` over the rows of ``x`` (N, d) -> (c,)."""
    y = _64(x).reshape(-1, x.shape[-1]) @ _64(w)
    if b is not None:
        y = y + _64(b)
    return y.pow(2).mean(0).sqrt()


def _sqrt_psd(m: torch.Tensor, rel_floor: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M^{1/2}, M^{-1/2})`` of a symmetric PSD matrix, eigenvalues floored at ``rel_floor·λ_max``."""
    lam, q = torch.linalg.eigh(m)
    lam = lam.clamp_min(rel_floor * lam.max().clamp_min(1e-300))
    return (q * lam.sqrt()) @ q.T, (q / lam.sqrt()) @ q.T


def conditioned_basis(w_k: torch.Tensor, r: int, kind: str = "svd", second_moment: torch.Tensor | None = None,
                      k_rms: torch.Tensor | None = None, w_v: torch.Tensor | None = None) -> torch.Tensor:
    """The r input directions ``P`` (d, r) whose coordinates ``z = x P`` the conditioned K-cache stores.

    Args:
        w_k: (d, e) key projection.
        r: number of extra coordinates (0 ≤ r ≤ d).
        kind: ``"svd"`` — the left singular vectors of ``W_K`` with the r smallest singular values (the
            directions ``X = K W_K⁻¹`` amplifies most); ``"svdv"`` — the same vectors ranked by how much
            they reach V, ``‖u_j^T W_V‖ / σ_j`` (needs ``w_v``); ``"act"`` — the same in the space of the real
            activations: whiten x by its second moment Σ and K by its column RMS, take the smallest singular
            directions of ``Σ^{1/2} W_K diag(1/k_rms)`` and map them back with ``Σ^{-1/2}``.
        second_moment: (d, d) ``X^T X / N`` of calibration activations (``"act"``).
        k_rms: (e,) RMS of each key column on the same activations (``"act"``).

    Returns:
        float64 (d, r), columns scaled so that each ``z`` coordinate has the mean magnitude of a key column.
    """
    w = _64(w_k)
    d = w.shape[0]
    if not 0 <= r <= d:
        raise ValueError(f"rank r must be in [0, {d}], got {r}")
    if kind not in ("svd", "svdv", "act"):
        raise ValueError(f"basis must be 'svd', 'svdv' or 'act', got {kind!r}")
    if kind != "act" or second_moment is None or k_rms is None:
        u, sv, _ = torch.linalg.svd(w, full_matrices=True)  # (d, d), singular values descending
        if kind == "svdv" and w_v is not None:
            sv = torch.cat((sv, sv.new_zeros(d - sv.shape[0])))
            reach = (u.T @ _64(w_v)).norm(dim=1) / sv.clamp_min(1e-300)
            u = u[:, reach.argsort()]  # ascending: the most amplified last
        p = u[:, d - r:]
        if second_moment is not None and k_rms is not None:  # scale to the keys' magnitude
            z_rms = (p * (_64(second_moment) @ p)).sum(0).clamp_min(1e-300).sqrt()
            p = p / z_rms * _64(k_rms).mean()
        return p
    half, inv_half = _sqrt_psd(_64(second_moment))
    g = half @ w / _64(k_rms).clamp_min(1e-30)  # whitened input -> normalized keys
    u = torch.linalg.svd(g, full_matrices=True).U
    p = inv_half @ u[:, d - r:]  # z = x P has unit RMS per coordinate
    return p * _64(k_rms).mean()


def coordinate_rms(second_moment: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """RMS of each coordinate of ``x P`` given the second moment of x: (r,)."""
    p = _64(p)
    return (p * (_64(second_moment) @ p)).sum(0).clamp_min(0).sqrt()
