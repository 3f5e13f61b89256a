"""The Triton int8/int4 decode kernels (kernels/triton/quant_decode.py) under Triton's interpreter, against the
pure-torch twin (exact scores and values) and a float64 oracle over the dequantized codes; the dispatch; a tiny
Llama generating through them."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (tests/conftest.py sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import tiny_model  # noqa: E402
from tolerances import assert_close  # noqa: E402
from triton_aot import assert_page_list, compile_for_sm90, kernel_device  # noqa: E402

import kvslim  # noqa: E402
from kvslim.caches.residual import ChannelQuantizedStore  # noqa: E402
from kvslim.caches.storage import QuantizedStore, StoreSpec  # noqa: E402
from kvslim.kernels import quant_decode as kernel  # noqa: E402
from kvslim.ops.quant import quantize  # noqa: E402
from kvslim.ops.quant_formats import quantize_asym  # noqa: E402

tq = pytest.importorskip("kvslim.kernels.triton.quant_decode")
DEVICE = kernel_device()  # CPU tensors under the interpreter, else CUDA; skips the module otherwise
pytestmark = pytest.mark.usefixtures("kernel_dev")  # stage 1 of gpu_check selects only such tests (issue 42)
F32 = torch.float32
NAN = float("nan")


def _dev(*ts):
    """``ts`` on the kernels' device (non-tensors as they are): inputs are built on the CPU, where the oracle and
    the twin run, and copied there."""
    return tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts)


def _codes(b, h, n, d, bits, gs, asym, sdt, gen):
    x = torch.randn(b, h, n, d, generator=gen) * 2
    if asym:
        return quantize_asym(x, bits, gs, sdt)
    c, s = quantize(x, bits, gs, sdt)
    return c, s, None


def _oracle(q, keys, values, n, lengths, kt, vt, mask, scaling):
    """float64 softmax attention, sequence by sequence, over keys/values (B, Hk, ≥n, D) the codes stand for (only
    the first lengths[b] slots), then the tail; mask columns: slot t, then n + j."""
    outs, lses = [], []
    for i in range(q.shape[0]):
        ln = n if lengths is None else int(lengths[i])
        k, v, cols = keys[i, :, :ln].double(), values[i, :, :ln].double(), torch.arange(ln)
        if kt is not None:
            k, v = torch.cat((k, kt[i].double()), 1), torch.cat((v, vt[i].double()), 1)
            cols = torch.cat((cols, n + torch.arange(kt.shape[2])))
        s = torch.einsum("hgd,htd->hgt", q[i].double(), k) * scaling
        if mask is not None:
            s = s + mask[min(i, mask.shape[0] - 1), cols].double()
        outs.append(torch.softmax(s, -1).nan_to_num(0.0) @ v)
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


def _check(args, oracle, splits, what, v_unrot=None):
    """Kernel (forced splits and the chosen count) == twin (exact paths) == float64 oracle; outputs finite."""
    ref, ref_lse = kernel.reference(*args, scores="exact", values="exact", v_unrot=v_unrot)
    assert_close(ref, oracle[0], F32, f"{what}: twin vs float64")
    for s in (*splits, 0):
        out, lse = (t.cpu() for t in tq.launch(*_dev(*args), splits=s, v_unrot=_dev(v_unrot)[0]))
        assert torch.isfinite(out).all(), f"{what}: non-finite output (splits={s})"
        assert_close(out, ref, F32, f"{what}: kernel vs twin (splits={s})")
        assert_close(out, oracle[0], F32, f"{what}: kernel vs float64 (splits={s})")
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(lse)), f"{what}: -inf lse rows differ (splits={s})"
        assert_close(lse[fin], ref_lse[fin], F32, f"{what}: lse (splits={s})")


CASES = [  # (head dim, group size, GQA group, bits, asymmetric, scale dtype, forced splits)
    (64, 32, 1, 8, False, torch.float32, (1, 3)),
    (64, 64, 4, 4, True, torch.float16, (2,)),
    (80, 16, 7, 4, True, torch.float32, (3,)),
    (80, 40, 4, 8, True, torch.float16, (2,)),
    (128, 32, 7, 4, False, torch.float16, (1,)),
    (256, 64, 1, 4, True, torch.bfloat16, (2,)),
    (256, 128, 4, 8, False, torch.float32, (3,)),
]


@pytest.mark.parametrize("d,gs,g,bits,asym,sdt,splits", CASES)
def test_kernel_matches_twin_and_float64(d, gs, g, bits, asym, sdt, splits):
    """Ragged lengths (one sequence with no coded token), an fp32 tail, a mask with -inf and finite entries (one
    sequence's tail fully masked), scales/zeros NaN in every slot past a sequence's length and past n."""
    gen = torch.Generator().manual_seed(d + gs + g + bits)
    b, h, n = 3, 2, 37
    kc, ks, kz = _codes(b, h, n + 5, d, bits, gs, asym, sdt, gen)
    vc, vs, vz = _codes(b, h, n + 5, d, bits, gs, asym, sdt, gen)
    keys = kernel.dequantize_codes(kc, ks, kz, bits, gs)  # before the poison
    values = kernel.dequantize_codes(vc, vs, vz, bits, gs)
    lengths = torch.tensor([n, 20, 0])
    for t in (ks, vs) + ((kz, vz) if asym else ()):
        for i, ln in enumerate(lengths.tolist()):
            t[i, :, ln:] = NAN
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 3, d, generator=gen)
    mask = torch.zeros(b, n + 3)
    mask[0, 5] = mask[0, n + 1] = float("-inf")
    mask[1, 7] = -2.5
    mask[2, n:] = float("-inf")  # no coded token and a masked tail: nothing to attend
    args = (q, kc, ks, kz, vc, vs, vz, bits, gs, 0, n, lengths, kt, vt, mask, d ** -0.5)
    _check(args, _oracle(q, keys, values, n, lengths, kt, vt, mask, d ** -0.5), splits, f"d={d} g={g} int{bits}")


@pytest.mark.parametrize("bits,asym,sdt,d,kcg,g", [(4, True, torch.float16, 64, 32, 4),
                                                   (8, False, torch.float32, 128, 16, 7)])
def test_kivi_keys_match_the_store_reads(bits, asym, sdt, d, kcg, g):
    """Per-channel key parameters over token groups (ChannelQuantizedStore's layout), a length inside a group."""
    torch.manual_seed(bits + d)
    b, h, n = 2, 2, 3 * kcg
    spec = StoreSpec(bits, 32, sdt, asymmetric=asym, channel_group=kcg, residual=kcg, flush=kcg)
    ks = ChannelQuantizedStore(spec, b, h, 4 * kcg, d, F32, torch.device("cpu"))
    vs = QuantizedStore(spec.for_values(), b, h, 4 * kcg, d, F32, torch.device("cpu"))
    ks.write(0, torch.randn(b, h, n, d))
    vs.write(0, torch.randn(b, h, n, d))
    keys, values = ks.read(0, n), vs.read(0, n)
    q = torch.randn(b, h, g, d)
    lengths = torch.tensor([n - 3, kcg + 5])
    args = (q, ks.data, ks.scale, ks.zero, vs.data, vs.scale, vs.zero, bits, 32, kcg, n, lengths, None, None, None,
            0.1)
    _check(args, _oracle(q, keys, values, n, lengths, None, None, None, 0.1), (2,), f"KIVI int{bits}")


@pytest.mark.parametrize("bits,asym,kcg,page", [(4, True, 32, 32), (8, False, 16, 64), (4, False, 0, 16)])
def test_page_list_reads_rows_in_place(bits, asym, kcg, page):
    """Sparse decode's page list: the kernel reads logical slot t at stored row pages[b, h, t // page]·page +
    t % page (pages in any order, per head, a last page cut by n) and equals the twin over the gathered rows
    (:func:`kernel.paged_rows`), the dispatch passing the list through, and a float64 oracle."""
    gen = torch.Generator().manual_seed(bits + page)
    b, h, g, d, stored = 2, 3, 4, 64, 8 * page
    x = torch.randn(b, h, stored, d, generator=gen) * 2
    if kcg:  # KIVI keys: per channel over token groups (the store's layout)
        spec = StoreSpec(bits, 32, torch.float16, asymmetric=asym, channel_group=kcg, residual=kcg, flush=kcg)
        ks = ChannelQuantizedStore(spec, b, h, stored, d, F32, torch.device("cpu"))
        ks.write(0, x)
        kc, ksc, kz, keys = ks.data, ks.scale, ks.zero, ks.read(0, stored)
    else:
        kc, ksc, kz = _codes(b, h, stored, d, bits, 32, asym, torch.float16, gen)
        keys = kernel.dequantize_codes(kc, ksc, kz, bits, 32)
    vc, vs, vz = _codes(b, h, stored, d, bits, 32, asym, torch.float16, gen)
    values = kernel.dequantize_codes(vc, vs, vz, bits, 32)
    pages = torch.stack([torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(h)]) for _ in range(b)])
    n = 3 * page + page // 2  # the fourth page cut
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 3, d, generator=gen)
    rows = (pages[..., None] * page + torch.arange(page)).reshape(b, h, -1)
    pick = lambda t: t.gather(2, rows[..., None].expand(b, h, rows.shape[-1], t.shape[-1]))  # noqa: E731
    oracle = _oracle(q, pick(keys), pick(values), n, None, kt, vt, None, d ** -0.5)
    gathered = [None if t is None else kernel.paged_rows(t, pages, page) for t in (kc, ksc, kz, vc, vs, vz)]
    ref, ref_lse = kernel.reference(q, *gathered, bits, 32, kcg, n, None, kt, vt, None, d ** -0.5, scores="exact",
                                    values="exact")
    assert_close(ref, oracle[0], F32, "twin over the gathered rows vs float64")
    args = _dev(q, kc, ksc, kz, vc, vs, vz, bits, 32, kcg, n, None, kt, vt, None, d ** -0.5)
    assert_page_list(tq.launch, kernel.quant_decode, args, pages, page, ref, ref_lse, stored // page)


@pytest.mark.parametrize("bits,d,g", [(4, 64, 4), (8, 128, 1)])
def test_rotated_values_with_a_tail(bits, d, g):
    """Value codes hold v·R: the merged coded sum is taken back by v_unrot = Rᵀ, the tail is added in its own
    basis (not rotated); without v_unrot the result is far off."""
    gen = torch.Generator().manual_seed(bits + d + g)
    b, h, n = 2, 2, 70
    ks = QuantizedStore(StoreSpec(bits, 64, torch.float16, asymmetric=True), b, h, n, d, F32, torch.device("cpu"))
    vs = QuantizedStore(StoreSpec(bits, 64, torch.float16, asymmetric=True, rotation="hadamard"), b, h, n, d, F32,
                        torch.device("cpu"))
    ks.write(0, torch.randn(b, h, n, d, generator=gen))
    vs.write(0, torch.randn(b, h, n, d, generator=gen) * 2)
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, 4, d, generator=gen), torch.randn(b, h, 4, d, generator=gen) * 3
    lengths = torch.tensor([n, 33])
    args = (q, ks.data, ks.scale, ks.zero, vs.data, vs.scale, vs.zero, bits, 64, 0, n, lengths, kt, vt, None, 0.125)
    oracle = _oracle(q, ks.read(0, n), vs.read(0, n), n, lengths, kt, vt, None, 0.125)  # reads: original basis
    _check(args, oracle, (1, 3), f"rotated int{bits}", v_unrot=vs.unrotation)
    wrong, _ = tq.launch(*_dev(*args), splits=2)
    assert (wrong.cpu().double() - oracle[0]).abs().max().item() > 0.1


def test_empty_coded_history_and_many_heads():
    """n = 0 with a tail, lengths all 0 with a tail, nothing at all (zeros, lse -inf); 33 query heads per KV head
    (two head blocks)."""
    gen = torch.Generator().manual_seed(5)
    b, h, d = 2, 1, 64
    kc, ks, kz = _codes(b, h, 8, d, 4, 32, True, F32, gen)
    q = torch.randn(b, h, 3, d, generator=gen)
    kt, vt = torch.randn(b, h, 2, d, generator=gen), torch.randn(b, h, 2, d, generator=gen)
    for n, lengths in ((0, None), (8, torch.tensor([0, 0]))):
        args = (q, kc, ks, kz, kc, ks, kz, 4, 32, 0, n, lengths, kt, vt, None, 0.125)
        _check(args, _oracle(q, kt[:, :, :0], vt[:, :, :0], n, torch.zeros(2), kt, vt, None, 0.125), (2,),
               f"empty (n={n})")
    out, lse = tq.launch(*_dev(q, kc, ks, kz, kc, ks, kz), 4, 32, 0, 0, None, None, None, None, 0.125)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    q33 = torch.randn(b, h, 33, d, generator=gen)
    args = (q33, kc, ks, kz, kc, ks, kz, 4, 32, 0, 8, torch.tensor([8, 5]), kt, vt, None, 0.125)
    oracle = _oracle(q33, kernel.dequantize_codes(kc, ks, kz, 4, 32), kernel.dequantize_codes(kc, ks, kz, 4, 32), 8,
                     torch.tensor([8, 5]), kt, vt, None, 0.125)
    _check(args, oracle, (), "33 heads per KV head")


def test_dispatch_takes_the_kernel_and_refuses_bad_input(monkeypatch):
    """KVSLIM_BACKEND=triton: quant_decode runs the kernel (counted) with exact scores whatever ``scores`` says;
    2-bit codes are not its inputs (twin, one warning); a wrong mask shape is refused by name."""
    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    calls = []
    launch = tq.launch
    monkeypatch.setattr(tq, "launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    gen = torch.Generator().manual_seed(9)
    kc, ks, kz = _dev(*_codes(1, 2, 40, 64, 4, 32, True, F32, gen))
    q = torch.randn(1, 2, 3, 64, generator=gen).to(DEVICE)
    args = (q, kc, ks, kz, kc, ks, kz, 4, 32, 0, 40)
    out, lse = kernel.quant_decode(*args, scaling=0.125, scores="int8", values="int8")
    ref, ref_lse = kernel.reference(*args, scaling=0.125, scores="exact", values="exact")
    assert calls == [1]
    assert_close(out, ref, F32, "dispatched kernel vs twin")
    assert_close(lse, ref_lse, F32, "dispatched lse")
    with pytest.raises(ValueError, match="mask must be"):
        kernel.quant_decode(*args, mask=torch.zeros(1, 39, device=DEVICE))
    assert tq.covers(q, kc, 2) is not None and tq.covers(torch.zeros(1, 1, 1, 512), kc, 4) is not None
    monkeypatch.setattr(kernel.backend, "_warned", set())
    with pytest.warns(UserWarning, match="Triton kernel does not take"):
        kernel.quant_decode(*_dev(torch.randn(1, 2, 1, 512), torch.zeros(1, 2, 4, 256, dtype=torch.uint8),
                                  torch.ones(1, 2, 4, 16), torch.zeros(1, 2, 4, 16),
                                  torch.zeros(1, 2, 4, 256, dtype=torch.uint8), torch.ones(1, 2, 4, 16),
                                  torch.zeros(1, 2, 4, 16)), 4, 32, 0, 4)
    monkeypatch.setenv("KVSLIM_BACKEND", "torch")
    kernel.quant_decode(*args)
    assert len(calls) == 2  # the bad mask reached the launcher (refused there); the torch backend never launches


def test_torch_compile_traces_the_op(monkeypatch):
    """The fake impl traces under torch.compile(fullgraph=True), called as the op and through the dispatch; the
    compiled calls give the eager result."""
    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    gen = torch.Generator().manual_seed(6)
    kc, ks, _ = _dev(*_codes(2, 2, 40, 64, 4, 32, False, F32, gen))
    q = torch.randn(2, 2, 3, 64, generator=gen).to(DEVICE)

    def f(q, kc, ks):
        out, lse = tq.op()(q, kc, ks, None, kc, ks, None, 4, 32, 0, 40, None, None, None, None, 0.125, 0, None)
        return out * 2, lse

    def g(q, kc, ks):
        return kernel.quant_decode(q, kc, ks, None, kc, ks, None, 4, 32, 0, 40, scaling=0.125)[0] + 1

    got, want = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kc, ks), f(q, kc, ks)
    assert_close(got[0], want[0], F32, "compiled out")
    assert_close(got[1], want[1], F32, "compiled lse")
    assert_close(torch.compile(g, backend="aot_eager", fullgraph=True)(q, kc, ks), g(q, kc, ks), F32, "dispatch")


FORMATS = [("int8", {}), ("int8", dict(window=16)),  # a ring: its mask hides the re-coded slot
           ("int4", dict(residual=32, sink=4)),  # KIVI keys, rotated values, sinks
           ("int4", dict(asymmetric=False, key_channel_group=0, value_rotation="none", residual=32, sink=0))]


@pytest.mark.parametrize("method,opts", FORMATS)
def test_generate_matches_the_twin(method, opts, monkeypatch, one_thread):
    """A tiny Llama (GQA 4:1, head dim 64) with a padded batch: greedy tokens under KVSLIM_BACKEND=triton equal
    KVSLIM_BACKEND=torch's (the twin, exact paths), every decode step took the fused path and launched the
    kernel."""
    from kvslim.adapters import sdpa

    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "exact")  # the twin's exact paths are the kernel's contract
    monkeypatch.setenv("KVSLIM_QUANT_VALUES", "exact")
    model = tiny_model("llama", kv_heads=1, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                       attn_implementation="sdpa").to(DEVICE)
    ids = torch.randint(1, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids, mask = _dev(ids, mask)
    calls, taken = [], []
    launch, decode = tq.launch, sdpa.quant.decode
    monkeypatch.setattr(tq, "launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    monkeypatch.setattr(sdpa.quant, "decode", lambda *a: taken.append(decode(*a)) or taken[-1])
    kvslim.apply(model, method, **opts)
    try:
        runs = {}
        for name in ("torch", "triton"):
            monkeypatch.setenv("KVSLIM_BACKEND", name)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True)
            runs[name] = out
    finally:
        kvslim.restore(model)
    steps = 4 * 2  # decode steps after the prompt × layers, per backend
    assert len(taken) == 2 * steps and all(t is not None for t in taken), "a decode step left the fused path"
    assert len(calls) == steps, f"the Triton kernel ran {len(calls)} times, expected {steps}"
    assert torch.equal(runs["triton"].sequences, runs["torch"].sequences), f"{method} {opts}: greedy tokens differ"
    for a, b in zip(runs["triton"].logits, runs["torch"].logits):
        assert_close(a, b, F32, f"{method} {opts}: logits")


@pytest.mark.parametrize("method,opts", [("int4", dict(residual=32, sink=4)), ("int2", dict(residual=64, sink=4)),
                                         ("turbo3", dict(residual=28, sink=4))])
def test_sparse_generate_reads_pages_in_place(method, opts, monkeypatch, one_thread):
    """Sparse decode through the Triton kernels (issue 48 item 3): every sparse step hands the kernel the page list
    (the codes read in place, nothing gathered) and the greedy tokens and logits equal the twin's
    (KVSLIM_BACKEND=torch, gathered rows)."""
    from kvslim.kernels import quant_decode_lowbit as ql
    from kvslim.kernels import turbo_decode as td

    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "exact")
    monkeypatch.setenv("KVSLIM_QUANT_VALUES", "exact")
    model = tiny_model("llama", kv_heads=1, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                       attn_implementation="sdpa").to(DEVICE)
    ids = _dev(torch.randint(1, 128, (1, 400), generator=torch.Generator().manual_seed(1)))[0]
    paged = []
    spies = {"int4": (tq, "launch"), "int2": (ql._triton(), "launch")}
    if method in spies:
        mod, name = spies[method]
        inner = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **kw: paged.append(kw.get("pages") is not None) or inner(*a, **kw))
    else:
        from kvslim.kernels.triton import turbo_decode as tt

        inner = tt.launch
        monkeypatch.setattr(tt, "launch", lambda *a: paged.append(a[-2] is not None) or inner(*a))
    kvslim.apply(model, method, sparse_budget=160 if method == "int2" else 128, **opts)
    try:
        runs = {}
        for name in ("torch", "triton"):
            monkeypatch.setenv("KVSLIM_BACKEND", name)
            with torch.no_grad():
                runs[name] = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                            return_dict_in_generate=True)
    finally:
        kvslim.restore(model)
    assert paged.count(True) == 3 * 2, f"sparse steps through a page list: {paged}"
    assert td is not None and torch.equal(runs["triton"].sequences, runs["torch"].sequences)
    for a, b in zip(runs["triton"].logits, runs["torch"].logits):
        assert_close(a, b, F32, f"sparse {method}: logits")


AOT = r'''
from kvslim.kernels.triton import quant_decode as tq

# int8 symmetric per token, int4 asymmetric KIVI (fp16 params), int4 asymmetric per token at D = 80 (bf16 params)
for d, bits, asym, gs, kcg, sdt, tail in ((128, 8, False, 64, 0, "fp32", False), (128, 4, True, 64, 32, "fp16", True),
                                           (80, 4, True, 16, 0, "bf16", True)):
    codes = "*u8" if asym or bits == 4 else "*i8"
    types = dict(Q="*fp32", KC=codes, VC=codes, KS="*" + sdt, KZ="*" + sdt, VS="*" + sdt, VZ="*" + sdt, KT="*fp32",
                 VT="*fp32", MASK="*fp32", LENGTHS="*i64", PO="*fp32", PL="*fp32", PAGES="*i64", scaling="fp32",
                 sp_b="i64", sp_h="i64")
    block_d = max(16, triton.next_power_of_2(d))
    block_n, warps = tq.tile_config(block_d)
    const = dict(D=d, BITS=bits, ASYM=asym, GROUP=gs, KCG=kcg, KW=d // kcg if kcg else 1, VGROUP=gs, HAS_LEN=True,
                 HAS_MASK=True, TAIL=tail, NHB=1, BLOCK_H=16, BLOCK_N=block_n, BLOCK_D=block_d, PAGE=0)
    # the shipped "ieee"; the other operand precisions of gpu_check's variant sweep (merge.DOT_CHOICES) on one config
    for dot in tq.DOT_CHOICES if kcg else ("ieee",):
        build(tq._quant_stage1, types, {**const, "DOT": dot}, warps)
    # a sparse step's page list (read in place), without the tail program
    build(tq._quant_stage1, types, {**const, "DOT": "ieee", "TAIL": False, "PAGE": 32}, warps)
    for unrot in (False, True):
        build(tq._quant_stage2, dict(PO="*fp32", PL="*fp32", M="*fp32", OUT="*fp32", LSE="*fp32"),
              dict(D=d, HAS_TAIL=tail, UNROT=unrot, NHB=1, BLOCK_H=16, BLOCK_D=block_d, BLOCK_K=min(64, block_d)),
              warps)
'''


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter runs the kernels as Python; this compiles them to a cubin for sm_90 (Triton's bundled ptxas,
    no GPU needed), so code that only the compiler rejects fails here too."""
    compile_for_sm90(AOT)


@pytest.mark.parametrize("method", ["int4", "int2", "turbo3"])
def test_a_multi_token_call_through_the_kernels_matches_the_twin(method, monkeypatch, one_thread):
    """A 17-token call over a 300-token history (issue 49: the G·S query rows of each KV head through the kernel in
    one launch, ≤ 32 rows per launch for the low-bit and turbo kernels), under KVSLIM_BACKEND=triton and =torch: the
    call's logits agree within fp32 tolerance, and the kernel launched."""
    from kvslim.adapters.compat import CACHE_KW
    from kvslim.attention import quant

    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "exact")
    monkeypatch.setenv("KVSLIM_QUANT_VALUES", "exact")
    model = tiny_model("llama", kv_heads=1, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                       attn_implementation="sdpa").to(DEVICE)
    ids = _dev(torch.randint(1, 128, (1, 317), generator=torch.Generator().manual_seed(0)))[0]
    from kvslim.kernels import backend

    calls, fallbacks = [], []
    real = quant.decode_call
    monkeypatch.setattr(quant, "decode_call", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(backend, "warn_fallback", lambda family, why: fallbacks.append((family, why)))
    kvslim.apply(model, method)
    try:
        out = {}
        for name in ("torch", "triton"):
            monkeypatch.setenv("KVSLIM_BACKEND", name)
            cache = kvslim.make_cache(model)
            with torch.no_grad():
                model(ids[:, :300], use_cache=True, **{CACHE_KW: cache})
                out[name] = model(ids[:, 300:], use_cache=True, **{CACHE_KW: cache}).logits
    finally:
        kvslim.restore(model)
    assert len(calls) == 2 * 2, "the call left the fused path"
    assert not fallbacks, f"a Triton kernel declined the call: {fallbacks}"
    assert_close(out["triton"], out["torch"], F32, f"{method}: a 17-token call")
