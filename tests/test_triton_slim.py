"""The Triton shared-rows decode kernels — slim attention option 2 (``kernels/triton/slim_decode.py``) and the
encoder-decoder cross-attention over E (``kernels/triton/encdec_decode.py``) — against their pure-torch twins and a
float64 oracle under ``TRITON_INTERPRET=1`` (CPU tensors; on a GPU machine run with ``TRITON_INTERPRET=0`` to test
the compiled kernels on CUDA tensors); the dispatch by ``KVSLIM_BACKEND``; ``torch.compile(fullgraph=True)`` of the
registered ops; a tiny MHA Llama and a tiny Whisper with ``slim`` generating HF's greedy tokens through them."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it first)

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import padded_batch, tiny_model  # noqa: E402
from tolerances import RATIO_FACTOR, RATIO_FLOOR, assert_rel_close, max_err  # noqa: E402
from triton_aot import compile_for_sm90, kernel_device  # noqa: E402

import kvslim  # noqa: E402
from kvslim.kernels import backend  # noqa: E402
from kvslim.kernels import encdec_decode as enc_kernel  # noqa: E402
from kvslim.kernels import slim_decode as slim_kernel  # noqa: E402
from kvslim.ops.rope import rotate, unrotate  # noqa: E402

triton = pytest.importorskip("triton")
from kvslim.kernels.triton import encdec_decode as te  # noqa: E402
from kvslim.kernels.triton import slim_decode as ts  # noqa: E402

F32, F64 = torch.float32, torch.float64
DEVICE = kernel_device()  # CPU tensors under the interpreter, else CUDA; skips the module otherwise
pytestmark = pytest.mark.usefixtures("kernel_dev")  # stage 1 of gpu_check selects only such tests (issue 42)



@pytest.fixture
def launches(monkeypatch):
    """Triton launches per family (the registered ops look ``launch`` up at call time)."""
    calls = {"slim": 0, "encdec": 0}

    def counted(module, key):
        original = module.launch

        def launch(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, "launch", launch)

    counted(ts, "slim")
    counted(te, "encdec")
    return calls


def assert_ratio(opt, twin, ref64, what):
    """The error-ratio rule against float64 with fp32 arithmetic (both paths widen the rows to fp32)."""
    e_opt, e_twin = max_err(opt, ref64), max_err(twin, ref64)
    assert e_opt <= RATIO_FACTOR * e_twin + RATIO_FLOOR[F32], f"{what}: {e_opt:.3e} vs twin {e_twin:.3e}"


def _table(b, n, r, g):
    """A RoPE table (B, n, R) of positions with random offsets per sequence (HF layout: equal halves)."""
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=F32) / r))
    pos = torch.arange(n, dtype=F32)[None, :] + torch.randint(0, 50, (b, 1), generator=g)
    emb = torch.cat((pos[..., None] * inv,) * 2, dim=-1)
    return emb.cos(), emb.sin()


def slim_oracle(q, rows, cos, sin, mask, lengths, scaling, rotated):
    """float64, per sequence, only the rows it owns: (u (B, h, c), lse (B, h))."""
    b, h, dk = q.shape
    e = h * dk
    us, lses = [], []
    for i in range(b):
        n = int(lengths[i])
        src = rows[i, :n].double()
        keys = src[:, :e].view(n, h, dk).transpose(0, 1)  # (h, n, dk)
        score_keys = keys
        if cos is not None:
            cs, sn = (z[min(i, z.shape[0] - 1), :n].double() for z in (cos, sin))
            if rotated:
                src = torch.cat((unrotate(keys, cs, sn).transpose(0, 1).reshape(n, e), src[:, e:]), dim=1)
            else:
                score_keys = rotate(keys, cs, sn)
        s = torch.einsum("hd,hnd->hn", q[i].double(), score_keys) * scaling
        if mask is not None:
            s = s + mask[min(i, mask.shape[0] - 1), :n].double()
        us.append(torch.softmax(s, -1) @ src)
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(us), torch.stack(lses)


def slim_case(b, h, dk, extra, n, rot, rotated, dtype, mask_rows, seed):
    """Random slim inputs with ragged lengths; rows and mask entries past each length NaN-poisoned."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, dk, generator=g)
    rows = (torch.randn(b, n, h * dk + extra, generator=g) * 1.5).to(dtype)
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    lengths[0] = n
    cos = sin = None
    if rot:
        cos, sin = _table(b, n, rot, g)
    mask = None if mask_rows == 0 else torch.randn(mask_rows, n, generator=g)
    for i in range(b):
        rows[i, lengths[i]:] = float("nan")
        if mask is not None and mask_rows == b:
            mask[i, lengths[i]:] = float("nan")
    return q, rows, cos, sin, mask, lengths


SLIM_CASES = [  # b, h, dk, extra (conditioning columns), n, R, rotated, rows dtype, mask rows, splits
    (3, 2, 64, 0, 45, 0, False, F32, 3, 3),
    (2, 3, 80, 8, 37, 80, False, F32, 1, 2),
    (2, 3, 80, 0, 40, 32, True, F32, 2, 0),
    (2, 2, 128, 0, 50, 128, True, torch.bfloat16, 0, 4),
    (3, 2, 128, 16, 33, 64, False, torch.bfloat16, 3, 1),
    (2, 4, 64, 0, 30, 64, False, torch.float16, 0, 2),
]


@pytest.mark.parametrize("b,h,dk,extra,n,rot,rotated,dtype,mask_rows,splits", SLIM_CASES)
def test_slim_kernel_matches_twin_and_float64(b, h, dk, extra, n, rot, rotated, dtype, mask_rows, splits):
    q, rows, cos, sin, mask, lengths = slim_case(b, h, dk, extra, n, rot, rotated, dtype, mask_rows, seed=dk + n)
    args = (q.to(DEVICE), rows.to(DEVICE), *(None if z is None else z.to(DEVICE) for z in (cos, sin, mask)),
            lengths.to(DEVICE), 0.37, rotated)
    u, lse = ts.launch(*args, splits=splits)
    u_twin, lse_twin = slim_kernel.reference(*args)
    u64, lse64 = slim_oracle(q, rows, cos, sin, mask, lengths, 0.37, rotated)
    u, lse = u.cpu(), lse.cpu()
    assert torch.isfinite(u).all() and torch.isfinite(lse).all(), "NaN past a length leaked"
    assert_rel_close(u, u_twin.cpu(), F32, "u vs twin")
    assert_rel_close(lse, lse_twin.cpu(), F32, "lse vs twin")
    assert_ratio(u, u_twin.cpu(), u64, "u vs float64")
    assert_ratio(lse, lse_twin.cpu(), lse64, "lse vs float64")


@pytest.mark.parametrize("rotated", [False, True])
def test_slim_column_tiles_and_mapped(monkeypatch, rotated):
    """u tiled over c by the grid (a small register budget: 4 column tiles, 8 when un-rotating; a head's keys across
    two of them), and the mapped op (u · value_map per head) against the mapped twin."""
    monkeypatch.setattr(ts, "MAX_ACC", 16 * 64)  # h_pad 16 → BLOCK_C 64 over c = 3·80 + 8
    q, rows, cos, sin, mask, lengths = slim_case(2, 3, 80, 8, 40, 48, rotated, F32, 2, seed=7)
    assert triton.cdiv(rows.shape[2], ts.tiles(3, rows.shape[2], rotated)[1]) == (8 if rotated else 4)
    u, lse = ts.launch(q, rows, cos, sin, mask, lengths, 0.5, rotated, splits=3)
    u64, lse64 = slim_oracle(q, rows, cos, sin, mask, lengths, 0.5, rotated)
    u_twin, _ = slim_kernel.reference(q, rows, cos, sin, mask, lengths, 0.5, rotated)
    assert_ratio(u, u_twin, u64, "tiled u vs float64")
    assert_rel_close(lse, lse64.float(), F32, "tiled lse")
    vmap = torch.randn(3, rows.shape[2], 80, generator=torch.Generator().manual_seed(1)) / 16
    out, lse_m = ts.slim_decode_mapped(q, rows, vmap, cos, sin, mask, lengths, 0.5, rotated, splits=2)
    out_twin, _ = slim_kernel.reference_mapped(q, rows, vmap, cos, sin, mask, lengths, 0.5, rotated)
    assert_rel_close(out, out_twin, F32, "mapped out vs twin")
    assert_ratio(out, out_twin, torch.einsum("bhc,hck->bhk", u64, vmap.double()), "mapped out vs float64")
    assert_rel_close(lse_m, lse64.float(), F32, "mapped lse")


def encdec_oracle(qt, enc, mask, lengths, scaling):
    us, lses = [], []
    for i in range(qt.shape[0]):
        n = int(lengths[i])
        src = enc[i, :n].double()
        s = qt[i].double() @ src.T * scaling
        if mask is not None:
            s = s + mask[min(i, mask.shape[0] - 1), :n].double()
        us.append(torch.softmax(s, -1) @ src)
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(us), torch.stack(lses)


ENCDEC_CASES = [  # b, h, d, n, rows dtype, mask rows, splits, small register budget (column tiles)
    (3, 4, 64, 45, F32, 3, 3, False),
    (2, 5, 80, 37, torch.bfloat16, 1, 2, False),
    (2, 2, 128, 50, torch.float16, 0, 0, False),
    (2, 6, 96, 40, F32, 2, 2, True),
]


@pytest.mark.parametrize("b,h,d,n,dtype,mask_rows,splits,tiled", ENCDEC_CASES)
def test_encdec_kernel_matches_twin_and_float64(monkeypatch, b, h, d, n, dtype, mask_rows, splits, tiled):
    if tiled:
        monkeypatch.setattr(ts, "MAX_ACC", 16 * 32)  # BLOCK_C 32: 3 column tiles of d = 96
    g = torch.Generator().manual_seed(d + n)
    qt = torch.randn(b, h, d, generator=g) / d ** 0.5
    enc = (torch.randn(b, n, d, generator=g) * 2).to(dtype)
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    lengths[0] = n
    mask = None if mask_rows == 0 else torch.randn(mask_rows, n, generator=g)
    for i in range(b):
        enc[i, lengths[i]:] = float("nan")
    u, lse = te.launch(qt, enc, mask, lengths, 0.9, splits=splits)
    u_twin, lse_twin = enc_kernel.reference(qt, enc, mask, lengths, 0.9)
    u64, lse64 = encdec_oracle(qt, enc, mask, lengths, 0.9)
    assert torch.isfinite(u).all(), "NaN past a length leaked"
    assert_rel_close(u, u_twin, F32, "u vs twin")
    assert_ratio(u, u_twin, u64, "u vs float64")
    assert_ratio(lse, lse_twin, lse64, "lse vs float64")
    dk = 16
    q = torch.randn(b, h, dk, generator=g)
    w_k, w_v = torch.randn(h, dk, d, generator=g) / d ** 0.5, torch.randn(h, dk, d, generator=g)
    b_v = torch.randn(h, dk, generator=g)
    for dk_last in (False, True):
        wk, wv = (w.transpose(1, 2).contiguous() if dk_last else w for w in (w_k, w_v))
        out, _ = te.encdec_decode_mapped(q, enc, wk, wv, b_v, mask, lengths, 0.9, dk_last, splits)
        out_twin, _ = enc_kernel.reference_mapped(q, enc, wk, wv, b_v, mask, lengths, 0.9, dk_last)
        assert_rel_close(out, out_twin, F32, f"mapped (dk_last={dk_last}) vs twin")


def test_whisper_style_padded_batch_equals_each_sequence_alone():
    """A padded batch of encoder outputs (3 clips of 60, 41 and 17 frames, NaN past each) through ``lengths`` gives
    each clip's own cross-attention, computed alone without padding."""
    g = torch.Generator().manual_seed(11)
    h, d, frames = 6, 64, (60, 41, 17)
    enc = torch.full((3, max(frames), d), float("nan"))
    for i, f in enumerate(frames):
        enc[i, :f] = torch.randn(f, d, generator=g)
    q = torch.randn(3, h, 16, generator=g)
    w_k, w_v, b_v = torch.randn(h, 16, d, generator=g) / 8, torch.randn(h, 16, d, generator=g), torch.randn(h, 16)
    lengths = torch.tensor(frames)
    out, _ = te.encdec_decode_mapped(q, enc, w_k, w_v, b_v, None, lengths, 0.125, splits=2)
    for i, f in enumerate(frames):
        alone, _ = enc_kernel.reference_mapped(q[i:i + 1], enc[i:i + 1, :f], w_k, w_v, b_v, None, None, 0.125)
        assert_rel_close(out[i:i + 1], alone, F32, f"clip {i} in the batch vs alone")


# ---- dispatch -------------------------------------------------------------------------------------------------


def test_dispatch_by_backend(monkeypatch, launches):
    q, rows, cos, sin, mask, lengths = slim_case(2, 2, 64, 0, 20, 64, False, F32, 2, seed=3)
    qt, enc = torch.randn(2, 2, 32), torch.randn(2, 20, 32)
    monkeypatch.setenv(backend.ENV, "triton")
    assert slim_kernel.choose(q, rows, cos, sin, mask, lengths) == "triton"
    u, _ = slim_kernel.slim_decode(q, rows, cos, sin, mask, lengths, 0.5)
    assert_rel_close(u, slim_kernel.reference(q, rows, cos, sin, mask, lengths, 0.5)[0], F32, "dispatched slim")
    v, _ = enc_kernel.encdec_decode(qt, enc, None, lengths, 0.5)
    assert_rel_close(v, enc_kernel.reference(qt, enc, None, lengths, 0.5)[0], F32, "dispatched encdec")
    assert launches == {"slim": 1, "encdec": 1}
    with warnings.catch_warnings(record=True) as caught:  # float64 rows: the kernels do not take them
        warnings.simplefilter("always")
        backend._warned.discard("slim_decode (triton)")
        assert slim_kernel.choose(q, rows.double()) == "torch"
    assert any("twin" in str(w.message) for w in caught)
    monkeypatch.setenv(backend.ENV, "torch")
    assert slim_kernel.choose(q, rows) == "torch" and enc_kernel.choose(qt, enc) == "torch"
    slim_kernel.slim_decode(q, rows, cos, sin, mask, lengths, 0.5)
    assert launches == {"slim": 1, "encdec": 1}
    if DEVICE.type == "cpu":
        monkeypatch.setenv(backend.ENV, "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            slim_kernel.slim_decode(q, rows)


@pytest.mark.parametrize("bad,match", [
    (dict(cos=torch.ones(1, 20, 63), sin=torch.ones(1, 20, 63)), "cos must be"),
    (dict(mask=torch.zeros(2, 19)), "mask must be"),
    (dict(lengths=torch.tensor([3, 4], dtype=torch.int32)), "lengths must be"),
    (dict(rows=torch.zeros(2, 20, 100)), r"rows must be \(B=2, n, c ≥ h·dk=128\)"),
])
def test_bad_inputs_named(bad, match):
    args = dict(q=torch.randn(2, 2, 64), rows=torch.randn(2, 20, 128), cos=None, sin=None, mask=None, lengths=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ts.launch(**args, scaling=1.0, rotated=False)
    with pytest.raises(ValueError, match="enc must be"):
        te.launch(torch.randn(2, 2, 32), torch.randn(2, 20, 31), None, None, 1.0)


def test_torch_compile_fullgraph_traces_both_ops(launches):
    q, rows, cos, sin, mask, lengths = slim_case(2, 2, 16, 0, 20, 16, True, F32, 1, seed=5)
    qt, enc = torch.randn(2, 2, 32), torch.randn(2, 20, 32)
    slim_op, enc_op = ts.op(), te.op()

    def step(q, rows, cos, sin, mask, lengths, qt, enc):
        u, lse = slim_op(q, rows, cos, sin, mask, lengths, 0.25, True, 2)
        v, _ = enc_op(qt, enc, mask, lengths, 0.5, 0)
        return u.sum(-1) + v.sum(-1) + lse

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, rows, cos, sin, mask, lengths, qt, enc)
    assert_rel_close(got, step(q, rows, cos, sin, mask, lengths, qt, enc), F32, "compiled vs eager")
    assert launches["slim"] >= 2 and launches["encdec"] >= 2


# ---- end to end -----------------------------------------------------------------------------------------------


@torch.no_grad()
def _greedy(model, ids, mask, new=8):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("batch", [1, 2])
def test_tiny_llama_slim_generates_hf_tokens_through_triton(monkeypatch, launches, batch):
    """A tiny random MHA Llama (RoPE, K-cache) with ``slim`` under ``KVSLIM_BACKEND=triton``: greedy tokens equal
    HF's with its own cache (batch 1: the mapped op; batch 2, left-padded: the partials and the per-head map)."""
    monkeypatch.setenv(backend.ENV, "triton")
    ids, mask = padded_batch(batch, 6)
    ref = _greedy(tiny_model("llama", kv_heads=4), ids, mask)
    model = tiny_model("llama", kv_heads=4)
    plan = kvslim.apply(model, "slim", cache="k", rank=0)
    assert {lp.technique for lp in plan.layers} == {"slim-k"}
    got = _greedy(model, ids, mask)
    assert torch.equal(got, ref)
    assert launches["slim"] == 3 * 7  # 3 layers × 7 decode steps after the prefill


def _whisper_pair():
    from test_whisper_generate import whisper

    return whisper(0), whisper(0)


@pytest.mark.parametrize("cache", [None, "k"])
def test_tiny_whisper_slim_generates_hf_tokens_through_triton(monkeypatch, launches, cache):
    """A tiny random Whisper with ``slim`` (shared E for cross-attention; the planner's self-attention cache, or
    the K-cache) under ``KVSLIM_BACKEND=triton``: greedy tokens equal HF's with its own cache."""
    from test_whisper_generate import features

    monkeypatch.setenv(backend.ENV, "triton")
    ref_model, model = _whisper_pair()
    x = features(2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ref_model.generate(x, max_new_tokens=6, do_sample=False)
        kvslim.apply(model, "slim", **({} if cache is None else {"cache": cache}))
        got = model.generate(x, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, ref)
    steps = 2 * (got.shape[1] - 2)  # 2 decoder layers × decode steps (Whisper starts from its prompt tokens)
    assert launches["encdec"] >= steps  # cross-attention (and the X-cache's self-attention) through Triton
    if cache == "k":
        assert launches["slim"] >= steps


# ---- compiled for a GPU without one ---------------------------------------------------------------------------

AOT = r'''
from kvslim.kernels.triton import encdec_decode as te, merge as tm, slim_decode as ts

slim = ["Q", "ROWS", "COS", "SIN", "MASK", "LENGTHS", "PO", "PL", "s_rb", "s_rn", "s_cb", "s_cn", "s_mb", "h", "dk",
        "c", "n", "rot", "chunk", "scaling"]
for rope, unrot, dt in ((True, False, "bf16"), (False, True, "fp32")):
    types = ["*fp32", "*" + dt] + ["*fp32"] * 3 + ["*i64"] + ["*fp32"] * 2 + ["i32"] * 11 + ["fp32"]
    build(ts._slim_stage1, dict(zip(slim, types)), dict(H_PAD=16, DK_PAD=128, BLOCK_N=16, BLOCK_C=256,
          ROPE_KEYS=rope, UNROTATE=unrot, HAS_MASK=True, HAS_LENGTHS=True, DOT=ts.DOT_PRECISION), 8, 1)
enc = ["QT", "ENC", "MASK", "LENGTHS", "PO", "PL", "s_eb", "s_en", "s_mb", "h", "d", "n", "chunk", "scaling"]
types = ["*fp32", "*fp16", "*fp32", "*i64", "*fp32", "*fp32"] + ["i32"] * 7 + ["fp32"]
build(te._encdec_stage1, dict(zip(enc, types)), dict(H_PAD=16, BLOCK_N=16, BLOCK_D=64, BLOCK_C=512, HAS_MASK=True,
      HAS_LENGTHS=True, DOT=ts.DOT_PRECISION), 8, 1)
build(tm._merge_stage2, dict(PO="*fp32", PL="*fp32", OUT="*fp32", LSE="*fp32"), dict(H_PAD=16, BLOCK_C=256), 4, 1)
'''


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter runs the kernels as Python; this compiles them to a cubin for sm_90 (Triton's bundled ptxas,
    no GPU needed), so code only the compiler rejects (types, layouts, constexpr branches) fails here too."""
    compile_for_sm90(AOT)
