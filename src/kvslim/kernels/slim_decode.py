"""Fused CPU decode kernel of slim attention over a K-only cache (one query token, fp32, optional RoPE).

One pass over the cached rows per step, parallel over (sequence, chunk of positions) with OpenMP: per row,
the h scores with the RoPE rotation done on the fly (raw storage) and, per chunk, a local softmax and the
accumulation ``u_i += p_i,t · row_t`` over the whole row (un-rotated on the fly for rotated storage); the
chunks are merged exactly (log-sum-exp). Same math as the torch path of
:func:`kvslim.attention.slim.slim_attention` (its twin and fallback, tested against each other).

The C source is compiled with gcc on first use into a per-user temp directory keyed by a hash of the
source, flags and CPU; if that fails, :func:`load` warns once and returns ``None`` (callers fall back).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>

#define TILE 48

/* one (sequence b, chunk [t0, t1)) task: scores, local softmax, partial u; out = (h, width + 2): m, l, acc */
static inline __attribute__((always_inline)) void chunk_task(const float *C, int64_t width, const float *q, int64_t h, int64_t dk, int64_t R,
                       const float *cs, const float *sn, const float *mask, float scaling, int rotated,
                       int64_t t0, int64_t t1, float *out, float *sc, float *rowbuf) {
    const int64_t m = t1 - t0, half = R / 2;
    for (int64_t t = t0; t < t1; ++t) {
        const float *row = C + t * width;
        const float *c = cs ? cs + t * R : 0, *s = sn ? sn + t * R : 0;
        for (int64_t j = 0; j < h; ++j) {
            const float *k = row + j * dk, *qj = q + j * dk;
            float acc = 0.f;
            if (R > 0 && !rotated) {
                #pragma omp simd reduction(+:acc)
                for (int64_t i = 0; i < half; ++i) {
                    float k1 = k[i], k2 = k[i + half];
                    acc += qj[i] * (k1 * c[i] - k2 * s[i]) + qj[i + half] * (k2 * c[i + half] + k1 * s[i + half]);
                }
                #pragma omp simd reduction(+:acc)
                for (int64_t i = R; i < dk; ++i) acc += qj[i] * k[i];
            } else {
                #pragma omp simd reduction(+:acc)
                for (int64_t i = 0; i < dk; ++i) acc += qj[i] * k[i];
            }
            sc[j * m + (t - t0)] = acc * scaling + (mask ? mask[t] : 0.f);
        }
    }
    for (int64_t j = 0; j < h; ++j) {
        float *sj = sc + j * m, mx = -INFINITY, l = 0.f;
        for (int64_t i = 0; i < m; ++i) mx = sj[i] > mx ? sj[i] : mx;
        for (int64_t i = 0; i < m; ++i) { sj[i] = expf(sj[i] - mx); l += sj[i]; }
        float *o = out + j * (width + 2);
        o[0] = mx; o[1] = l;
        memset(o + 2, 0, sizeof(float) * width);
    }
    const float *rows = C + t0 * width;
    int64_t rstride = width;
    if (R > 0 && rotated) {  /* un-rotate (by -theta) the chunk's keys into rowbuf, copy the rest */
        for (int64_t t = t0; t < t1; ++t) {
            const float *row = C + t * width, *c = cs + t * R, *s = sn + t * R;
            float *rb = rowbuf + (t - t0) * width;
            memcpy(rb, row, sizeof(float) * width);
            for (int64_t j = 0; j < h; ++j) {
                const float *k = row + j * dk;
                float *r = rb + j * dk;
                #pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    float k1 = k[i], k2 = k[i + half];
                    r[i] = k1 * c[i] + k2 * s[i];
                    r[i + half] = k2 * c[i + half] - k1 * s[i + half];
                }
            }
        }
        rows = rowbuf;
    }
    /* acc_j += sum_t p_jt row_t: a small GEMM, register-blocked as 4 heads x TILE columns */
    int64_t j = 0;
    for (; j + 4 <= h; j += 4) {
        const float *p0 = sc + j * m, *p1 = p0 + m, *p2 = p1 + m, *p3 = p2 + m;
        float *o0 = out + j * (width + 2) + 2, *o1 = o0 + width + 2, *o2 = o1 + width + 2, *o3 = o2 + width + 2;
        int64_t i0 = 0;
        for (; i0 + TILE <= width; i0 += TILE) {
            float a0[TILE] = {0}, a1[TILE] = {0}, a2[TILE] = {0}, a3[TILE] = {0};
            for (int64_t t = 0; t < m; ++t) {
                const float *r = rows + t * rstride + i0;
                const float q0 = p0[t], q1 = p1[t], q2 = p2[t], q3 = p3[t];
                #pragma omp simd
                for (int i = 0; i < TILE; ++i) {
                    a0[i] += q0 * r[i]; a1[i] += q1 * r[i]; a2[i] += q2 * r[i]; a3[i] += q3 * r[i];
                }
            }
            memcpy(o0 + i0, a0, sizeof a0); memcpy(o1 + i0, a1, sizeof a1);
            memcpy(o2 + i0, a2, sizeof a2); memcpy(o3 + i0, a3, sizeof a3);
        }
        for (; i0 < width; ++i0) {
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
            for (int64_t t = 0; t < m; ++t) {
                const float r = rows[t * rstride + i0];
                a0 += p0[t] * r; a1 += p1[t] * r; a2 += p2[t] * r; a3 += p3[t] * r;
            }
            o0[i0] = a0; o1[i0] = a1; o2[i0] = a2; o3[i0] = a3;
        }
    }
    for (; j < h; ++j) {
        const float *p = sc + j * m;
        float *o = out + j * (width + 2) + 2;
        for (int64_t t = 0; t < m; ++t) {
            const float *r = rows + t * rstride;
            #pragma omp simd
            for (int64_t i = 0; i < width; ++i) o[i] += p[t] * r[i];
        }
    }
}

/* u (B, h, width) = softmax(scaling * q . rope(K) + mask) . C  for one query token per sequence */
int kvslim_slim_decode(const float *C, int64_t B, int64_t n, int64_t width, int64_t stride_b,
                       const float *q, int64_t h, int64_t dk, int64_t R,
                       const float *cs, const float *sn, int64_t tab_stride_b,
                       const float *mask, int64_t mask_stride_b, float scaling, int rotated,
                       float *u, float *work, int64_t chunk, int nthreads) {
    const int64_t nc = (n + chunk - 1) / chunk, rw = width + 2;
    int err = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float *sc = malloc(sizeof(float) * (size_t)(h * chunk)), *rowbuf = malloc(sizeof(float) * (size_t)(width * chunk));
        if (!sc || !rowbuf) {
            #pragma omp atomic write
            err = 1;
        } else {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < B * nc; ++task) {
                const int64_t b = task / nc, ck = task % nc, t0 = ck * chunk, t1 = t0 + chunk < n ? t0 + chunk : n;
                const float *Cb = C + b * stride_b, *qb = q + b * h * dk;
                const float *cb = cs ? cs + b * tab_stride_b : 0, *sb = sn ? sn + b * tab_stride_b : 0;
                const float *mb = mask ? mask + b * mask_stride_b : 0;
                float *ob = work + task * h * rw;
                /* constant head sizes let the compiler unroll the short per-head loops */
                if (dk == 64 && R == 64)
                    chunk_task(Cb, width, qb, h, 64, 64, cb, sb, mb, scaling, rotated, t0, t1, ob, sc, rowbuf);
                else if (dk == 128 && R == 128)
                    chunk_task(Cb, width, qb, h, 128, 128, cb, sb, mb, scaling, rotated, t0, t1, ob, sc, rowbuf);
                else if (dk == 64 && R == 0)
                    chunk_task(Cb, width, qb, h, 64, 0, cb, sb, mb, scaling, rotated, t0, t1, ob, sc, rowbuf);
                else
                    chunk_task(Cb, width, qb, h, dk, R, cb, sb, mb, scaling, rotated, t0, t1, ob, sc, rowbuf);
            }
        }
        free(sc);
        free(rowbuf);
    }
    if (err) return 1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t bj = 0; bj < B * h; ++bj) {
        const int64_t b = bj / h, j = bj % h;
        float mx = -INFINITY, den = 0.f, *o = u + bj * width;
        for (int64_t ck = 0; ck < nc; ++ck) {
            float mc = work[((b * nc + ck) * h + j) * rw];
            mx = mc > mx ? mc : mx;
        }
        memset(o, 0, sizeof(float) * width);
        for (int64_t ck = 0; ck < nc; ++ck) {
            const float *w = work + ((b * nc + ck) * h + j) * rw;
            const float f = expf(w[0] - mx);
            den += f * w[1];
            #pragma omp simd
            for (int64_t i = 0; i < width; ++i) o[i] += f * w[2 + i];
        }
        const float inv = 1.f / den;
        #pragma omp simd
        for (int64_t i = 0; i < width; ++i) o[i] *= inv;
    }
    return 0;
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c99")
CHUNK = 256  # positions per task: a chunk of 768-wide fp32 rows stays in L2 between its two passes


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor() + platform.machine()


def _build_dir() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = os.path.join(tempfile.gettempdir(), f"kvslim-kernels-{uid}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first call, cached on disk), or ``None`` with a warning."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        warnings.warn("kvslim: no C compiler found; slim decode uses the torch path", stacklevel=2)
        return None
    key = hashlib.sha256("\0".join((SOURCE, cc, *FLAGS, _cpu_tag())).encode()).hexdigest()[:16]
    lib_path = os.path.join(_build_dir(), f"slim_decode_{key}.so")
    try:
        if not os.path.exists(lib_path):
            fd, src = tempfile.mkstemp(suffix=".c", dir=_build_dir())
            with os.fdopen(fd, "w") as f:
                f.write(SOURCE)
            tmp = src[:-2] + ".so"
            try:
                subprocess.run([cc, *FLAGS, "-o", tmp, src, "-lm"], check=True, capture_output=True, text=True,
                               timeout=120)
                os.replace(tmp, lib_path)  # atomic: concurrent builders never see a half-written library
            finally:
                for p in (src, tmp):
                    if os.path.exists(p):
                        os.remove(p)
        lib = ctypes.CDLL(lib_path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        warnings.warn(f"kvslim: could not build the slim decode kernel ({detail}); using the torch path",
                      stacklevel=2)
        return None
    fn = lib.kvslim_slim_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, ctypes.c_float,
                   ctypes.c_int, ptr, ptr, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def supported(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether :func:`slim_decode` handles these inputs (CPU, fp32, one query token)."""
    return (q.device.type == "cpu" and cache.device.type == "cpu" and q.dtype == torch.float32
            and cache.dtype == torch.float32 and q.shape[2] == 1)


def slim_decode(lib: ctypes.CDLL, q: torch.Tensor, cache: torch.Tensor, mask: torch.Tensor | None,
                scaling: float, cos: torch.Tensor | None, sin: torch.Tensor | None,
                rotated: bool) -> torch.Tensor:
    """``u = softmax(scaling · q·rope(K)ᵀ + mask) · C`` for one query token, fp32 (see :func:`supported`).

    Args:
        q: (B, h, 1, dk) queries, RoPE applied.
        cache: (B, n, c) stored rows, keys in the first h·dk columns (row stride c; batch stride free).
        mask: fp32 additive mask broadcastable to (B, h, 1, n) and constant over heads, or ``None``.
        cos, sin: (B|1, n, R) RoPE table of the cached positions, or ``None`` (no RoPE).
        rotated: keys stored with RoPE applied (un-rotated for ``u``) rather than raw (rotated for scores).

    Returns:
        u: (B, h, 1, c) fp32.
    """
    b, h, _, dk = q.shape
    n, width = cache.shape[1], cache.shape[2]
    if cache.stride(2) != 1 or cache.stride(1) != width:
        cache = cache.contiguous()
    qc = q.reshape(b, h, dk).contiguous()
    r = 0 if cos is None else cos.shape[-1]
    tabs = (None, None)
    tab_stride = 0
    if r:
        cos, sin = (z.float().expand(-1, n, r).contiguous() for z in (cos, sin))
        tab_stride = 0 if cos.shape[0] == 1 else n * r
        tabs = (cos, sin)
    m, m_stride = None, 0
    if mask is not None:
        m = mask.float().reshape(mask.shape[0], -1, mask.shape[-1])
        if m.shape[1] != 1:
            raise ValueError("the kernel takes a mask shared by all heads")
        m = m[:, 0].expand(-1, n).contiguous()  # (B|1, n)
        m_stride = 0 if m.shape[0] == 1 else n
    nc = (n + CHUNK - 1) // CHUNK
    u = torch.empty(b, h, 1, width)
    work = torch.empty(b * nc * h * (width + 2))
    rc = lib.kvslim_slim_decode(
        cache.data_ptr(), b, n, width, cache.stride(0), qc.data_ptr(), h, dk, r,
        tabs[0].data_ptr() if r else None, tabs[1].data_ptr() if r else None, tab_stride,
        m.data_ptr() if m is not None else None, m_stride, float(scaling), int(rotated),
        u.data_ptr(), work.data_ptr(), CHUNK, torch.get_num_threads())
    if rc:
        raise MemoryError("slim decode kernel: out of memory for its per-thread buffers")
    return u
