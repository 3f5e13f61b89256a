"""The Triton low-bit decode kernels (``kernels/triton/quant_decode_lowbit.py``: 3-bit / 2-bit asymmetric codes, the
``int2`` method) against the pure-torch twin and a float64 oracle under ``TRITON_INTERPRET=1`` (CPU tensors; on a
GPU machine run with ``TRITON_INTERPRET=0`` to test the compiled kernels on CUDA tensors); the dispatch by
``KVSLIM_BACKEND``; ``torch.compile(fullgraph=True)`` of the registered op; a tiny Llama with ``int2`` generating the
same greedy tokens through the Triton backend as through the twin."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it first)

import pytest  # noqa: E402
import torch  # noqa: E402
from test_quant_decode_lowbit import _oracle, _random_format  # noqa: E402
from tolerances import assert_close  # noqa: E402
from triton_aot import assert_page_list, compile_for_sm90, kernel_device  # noqa: E402

import kvslim  # noqa: E402
from kvslim.kernels import backend  # noqa: E402
from kvslim.kernels import quant_decode_lowbit as kernel  # noqa: E402

triton = pytest.importorskip("triton")
from kvslim.kernels.triton import quant_decode_lowbit as tq  # noqa: E402

F32 = torch.float32
DEVICE = kernel_device()  # CPU tensors under the interpreter, else CUDA; skips the module otherwise
pytestmark = pytest.mark.usefixtures("kernel_dev")  # stage 1 of gpu_check selects only such tests (issue 42)



def _poisoned(b, h, n, d, kb, vb, gs, kivi, sdt, lengths, gen, spare=9):
    """Random codes with ``spare`` slots past n; scales and zero-points NaN past each sequence's length (KIVI: past
    its last started token group, whose parameters are real)."""
    kc, ks, kz, vc, vs, vz = _random_format(b, h, n + spare, d, kb, vb, gs, kivi, sdt, gen)
    for i, ln in enumerate(lengths.tolist()):
        kfrom = -(-ln // kivi) * kivi if kivi else ln
        ks[i, :, kfrom:] = kz[i, :, kfrom:] = float("nan")
        vs[i, :, ln:] = vz[i, :, ln:] = float("nan")
    return tuple(t.to(DEVICE) for t in (kc, ks, kz, vc, vs, vz))


def _to(args):
    return tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args)


CASES = [  # (head dim, group size, GQA group, key bits, value bits, KIVI token group, scale dtype, mask rows)
    (64, 64, 1, 3, 2, 64, torch.float16, 3),  # the int2 default: 3-bit KIVI keys g64 + 2-bit values g64
    (128, 64, 4, 3, 2, 64, torch.bfloat16, 1),
    (80, 16, 7, 3, 2, 16, F32, 3),  # head dim 80 (3 bits need D % 8 == 0)
    (64, 32, 4, 2, 2, 32, torch.float16, 1),  # 2-bit KIVI keys
    (128, 32, 7, 2, 3, 0, F32, 3),  # per-token keys, 3-bit values
    (64, 16, 1, 3, 3, 0, torch.float16, 3),
    (64, 16, 3, 3, 2, 8, torch.float16, 1),  # KIVI groups of 8 < a block: key parameters per token
    (80, 80, 1, 3, 2, 0, torch.float16, 3),  # a group size that is no power of two: parameters gathered
]


@pytest.mark.parametrize("d,gs,g,kb,vb,kivi,sdt,mrows", CASES)
def test_kernel_matches_twin_and_float64(d, gs, g, kb, vb, kivi, sdt, mrows):
    """Ragged lengths (no multiple of a block or a token group; one empty history with a tail), NaN parameters past
    each length and past n, −inf masked coded and tail tokens, forced 1 / 2 / 3 splits: kernel == twin == float64."""
    gen = torch.Generator().manual_seed(d + 7 * g + kb + vb + kivi)
    block = tq.block_size(d, kivi)
    b, h, n, r = 3, 2, 4 * block + 44, 3  # 5 blocks: 3 splits of 2, 2, 1 blocks
    lengths = torch.tensor([n, n // 2 + 7, 0])
    codes = _poisoned(b, h, n, d, kb, vb, gs, kivi, sdt, lengths, gen)
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, r, d, generator=gen), torch.randn(b, h, r, d, generator=gen)
    mask = torch.zeros(mrows, n + r)
    mask[0, 5] = mask[-1, n + 1] = float("-inf")
    mask[-1, 64] = -3.0
    args = (q, *codes, kb, vb, gs, kivi, n, lengths, kt, vt, mask, d ** -0.5)
    args = _to(args)
    oracle, oracle_lse = _oracle(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    ref, ref_lse = kernel.reference(*args)
    assert_close(ref.cpu(), oracle, F32, "twin vs float64")
    for splits in (1, 2, 3):
        assert tq.choose_splits(b * h, n, block, 132, splits)[0] == splits
        out, lse = tq.launch(*args, splits)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_close(out.cpu(), oracle, F32, f"kernel (splits={splits}) vs float64")
        assert_close(lse.cpu(), oracle_lse, F32, f"kernel lse (splits={splits}) vs float64")
        assert_close(out, ref, F32, f"kernel (splits={splits}) vs twin")


def test_empty_history_and_fully_masked_rows():
    """n = 0 with a tail (nothing coded yet); a sequence whose every token is masked: zeros and lse −inf, as the
    twin; no tail and no mask at all."""
    gen = torch.Generator().manual_seed(11)
    b, h, g, d, r = 2, 2, 4, 64, 5
    codes = _poisoned(b, h, 0, d, 3, 2, 64, 64, torch.float16, torch.tensor([0, 0]), gen, spare=64)
    q, kt, vt = (torch.randn(b, h, x, d, generator=gen) for x in (g, r, r))
    mask = torch.zeros(b, r)
    mask[1] = float("-inf")
    args = _to((q, *codes, 3, 2, 64, 64, 0, None, kt, vt, mask, 0.125))
    out, lse = tq.launch(*args)
    ref, ref_lse = kernel.reference(*args)
    assert_close(out, ref, F32, "tail only")
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all() and torch.isfinite(lse[0]).all()
    assert_close(lse[0], ref_lse[0], F32, "tail only lse")
    codes = _random_format(b, h, 70, d, 2, 2, 32, 0, F32, gen)
    args = _to((q, *codes, 2, 2, 32, 0, 70, None, None, None, None, 0.125))
    for splits in (0, 2):
        assert_close(tq.launch(*args, splits)[0], kernel.reference(*args)[0], F32, f"no tail, no mask ({splits})")


def test_bad_input_is_refused_by_name():
    gen = torch.Generator().manual_seed(5)
    kc, ks, kz, vc, vs, vz = _to(_random_format(1, 2, 10, 64, 3, 2, 32, 0, F32, gen))
    q = torch.randn(1, 2, 1, 64, device=DEVICE)
    cases = [("group_size", dict(group_size=24)), ("k_codes", dict(n=11)), ("v_codes", dict(v_bits=3)),
             ("k_bits", dict(k_bits=4)), ("lengths", dict(lengths=torch.tensor([3], dtype=torch.int32))),
             ("mask", dict(mask=torch.zeros(1, 9))), ("k_tail", dict(k_tail=torch.zeros(1, 2, 2, 64),
                                                                    v_tail=torch.zeros(1, 2, 3, 64))),
             ("q must be float32", dict(q=q.half())), ("k_scale", dict(k_scale=ks[..., :1]))]
    base = dict(q=q, k_codes=kc, k_scale=ks, k_zero=kz, v_codes=vc, v_scale=vs, v_zero=vz, k_bits=3, v_bits=2,
                group_size=32, key_channel_group=0, n=10, lengths=None, k_tail=None, v_tail=None, mask=None,
                scaling=1.0)
    for what, change in cases:
        change = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()}
        with pytest.raises(ValueError, match=what):
            tq.launch(**{**base, **change})


def test_dispatch_follows_the_backend(monkeypatch):
    """KVSLIM_BACKEND=triton runs the launcher (counted), =torch never does; an input the kernels do not cover (a
    query that requires grad) runs the twin with one warning; a CPU query with a CUDA-less mix is refused."""
    calls = []
    launch = tq.launch
    monkeypatch.setattr(tq, "launch", lambda *a, **kw: calls.append(a[0].shape) or launch(*a, **kw))
    gen = torch.Generator().manual_seed(2)
    codes = _to(_random_format(2, 2, 40, 64, 3, 2, 64, 64, torch.float16, gen))
    q = torch.randn(2, 2, 3, 64, generator=gen).to(DEVICE)
    args = (q, *codes, 3, 2, 64, 64, 40)
    monkeypatch.setenv(backend.ENV, "triton")
    out, lse = kernel.quant_decode_lowbit(*args, scaling=0.3)
    assert calls == [q.shape]
    ref, ref_lse = kernel.reference(*args, scaling=0.3)
    assert_close(out, ref, F32, "dispatch triton")
    assert_close(lse, ref_lse, F32, "dispatch triton lse")
    backend._warned.discard(f"{kernel.FAMILY} (triton)")
    with pytest.warns(UserWarning, match="requires grad"):
        grad_out, _ = kernel.quant_decode_lowbit(q.clone().requires_grad_(), *codes, 3, 2, 64, 64, 40, scaling=0.3)
    assert len(calls) == 1 and grad_out.requires_grad
    monkeypatch.setenv(backend.ENV, "torch")
    kernel.quant_decode_lowbit(*args)
    assert len(calls) == 1
    if DEVICE.type == "cpu":
        monkeypatch.setenv(backend.ENV, "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            kernel.quant_decode_lowbit(*args)


def test_torch_compile_fullgraph_traces_the_op(monkeypatch):
    """The registered op (custom op + fake impl) and the dispatch that reaches it (KVSLIM_BACKEND=triton) trace under
    fullgraph=True and give the launcher's result; the compiled dispatch runs the launcher."""
    gen = torch.Generator().manual_seed(6)
    codes = _to(_random_format(2, 2, 64, 64, 3, 2, 64, 64, torch.float16, gen))
    q = torch.randn(2, 2, 3, 64, generator=gen).to(DEVICE)
    op = torch.ops.kvslim.quant_decode_lowbit_triton

    def f(q, kc, ks, kz, vc, vs, vz):
        out, lse = op(q, kc, ks, kz, vc, vs, vz, 3, 2, 64, 64, 64, None, None, None, None, 0.125)
        return out * 2, lse

    def dispatched(q, kc, ks, kz, vc, vs, vz):
        out, lse = kernel.quant_decode_lowbit(q, kc, ks, kz, vc, vs, vz, 3, 2, 64, 64, 64, scaling=0.125)
        return out * 2, lse

    want = f(q, *codes)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, *codes)
    assert_close(got[0], want[0], F32, "compiled out")
    assert_close(got[1], want[1], F32, "compiled lse")
    calls = []
    launch = tq.launch
    monkeypatch.setattr(tq, "launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    monkeypatch.setenv(backend.ENV, "triton")
    torch._dynamo.reset()
    got = torch.compile(dispatched, backend="aot_eager", fullgraph=True)(q, *codes)
    assert calls, "the compiled dispatch did not run the Triton launcher"
    assert_close(got[0], want[0], F32, "compiled dispatch out")
    assert_close(got[1], want[1], F32, "compiled dispatch lse")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="attention/quant.py hands CPU queries to the op (a CPU model here)")
def test_int2_llama_triton_backend_equals_the_twin(monkeypatch):
    """A tiny GQA Llama (head dim 64) with ``int2`` (3-bit KIVI keys, 2-bit rotated values, a prompt that flushes
    token groups into codes), greedy: KVSLIM_BACKEND=triton gives the twin's tokens, and its launcher ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    calls = []
    launch = tq.launch
    monkeypatch.setattr(tq, "launch", lambda *a, **kw: calls.append(a[11]) or launch(*a, **kw))
    kvslim.apply(model, "int2", residual=32, key_channel_group=32, group_size=32)
    try:
        runs = []
        for name in ("triton", "torch"):
            monkeypatch.setenv(backend.ENV, name)
            with torch.no_grad():
                runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                           output_logits=True, return_dict_in_generate=True))
            if name == "triton":
                assert calls and max(calls) >= 32, f"the Triton launcher ran {len(calls)} times (n: {calls})"
                seen = len(calls)
        assert len(calls) == seen  # the torch backend never reaches it
    finally:
        kvslim.restore(model)
    assert torch.equal(runs[0].sequences, runs[1].sequences), "greedy tokens differ between triton and torch"
    for a, b in zip(runs[0].logits, runs[1].logits):
        assert_close(a, b, F32, "decode logits triton vs torch")


@pytest.mark.parametrize("kb,vb,kivi,page", [(3, 2, 64, 64), (2, 2, 32, 64), (3, 3, 0, 16)])
def test_page_list_reads_rows_in_place(kb, vb, kivi, page):
    """Sparse decode's page list: slot t read at stored row pages[b, h, t // page]·page + t % page (pages in any
    order, per head, the last page cut by n, blocks cut to the page): the kernel equals the twin over the gathered
    rows, and the dispatch passes the list through."""
    gen = torch.Generator().manual_seed(kb + vb + kivi + page)
    b, h, g, d, gs = 2, 3, 4, 64, 32
    stored = 8 * page
    codes = _random_format(b, h, stored, d, kb, vb, gs, kivi, torch.float16, gen)
    pages = torch.stack([torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(h)]) for _ in range(b)])
    n = 3 * page + page // 2
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 3, d, generator=gen)
    from kvslim.kernels.quant_decode import paged_rows

    gathered = [paged_rows(t, pages, page) for t in codes]
    ref, ref_lse = kernel.reference(q, *gathered, kb, vb, gs, kivi, n, None, kt, vt, None, d ** -0.5)
    args = _to((q, *codes, kb, vb, gs, kivi, n, None, kt, vt, None, d ** -0.5))
    assert_page_list(tq.launch, kernel.quant_decode_lowbit, args, pages, page, ref, ref_lse, stored // page)


AOT = r'''
from kvslim.kernels.triton import quant_decode_lowbit as tq

for d, gs, kivi, sdt in ((64, 64, 64, "fp16"), (80, 80, 8, "bf16")):  # one KIVI row per block / gathers
    types = dict(Q="*fp32", KC="*u8", VC="*u8", LENGTHS="*i64", KT="*fp32", VT="*fp32", MASK="*fp32", PO="*fp32",
                 PL="*fp32", KS="*" + sdt, KZ="*" + sdt, VS="*" + sdt, VZ="*" + sdt, scaling="fp32", PAGES="*i64")
    d_pad = triton.next_power_of_2(d)
    for dot in tq.DOT_CHOICES if d == 64 else ("ieee",):  # gpu_check's operand precisions (merge.DOT_CHOICES)
        const = dict(D=d, D_PAD=d_pad, G_PAD=16, BLOCK_N=tq.block_size(d, kivi), KB=3, VB=2, GS=gs,
                     GS_POW2=gs & (gs - 1) == 0, KIVI=kivi, HAS_LENGTHS=True, HAS_TAIL=True, HAS_MASK=True, DOT=dot)
        build(tq._lowbit_stage1, types, {**const, "PAGE": 0}, 8)
    build(tq._lowbit_stage1, types, {**const, "DOT": "ieee", "PAGE": 64}, 8)  # a sparse step's page list
'''


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter runs the kernels as Python; this compiles them to a cubin for sm_90 (Triton's bundled ptxas,
    no GPU needed), so code only the compiler rejects (types, layouts, constexpr branches) fails here too."""
    compile_for_sm90(AOT)
