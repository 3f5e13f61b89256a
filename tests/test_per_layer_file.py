"""Calibrated ``per_layer`` files (issue 35): ``kvslim.save_per_layer`` / ``load_per_layer`` round trips (the int4
rotation choice, tensor entries), refusals by name (missing file, not a calibration file, another method, another
model or the same architecture with other weights, a layer outside the model), and ``kvslim calibrate`` ->
``kvslim eval --per-layer-file`` end to end on the built-in tiny model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import CALIB_OPTS as OPTS
from conftest import tiny_model
from safetensors.torch import save_file

import kvslim
from kvslim.calibration import calibrate
from kvslim.cli.main import main
from kvslim.per_layer_file import FORMAT, config_hash, read_per_layer


def test_int4_rotation_round_trip_and_apply(calib_model, calib_ids, tmp_path):
    per_layer = calibrate(calib_model, calib_ids, "int4", queries=32, **OPTS)
    path = kvslim.save_per_layer(tmp_path / "c.safetensors", per_layer, calib_model, "int4", name="tiny", options=OPTS,
                                 text="random ids", tokens=96, seconds=0.5)
    assert kvslim.load_per_layer(path, calib_model, "int4") == per_layer
    calib = read_per_layer(path)
    assert (calib.method, calib.model, calib.options, calib.text, calib.tokens, calib.num_layers) == (
        "int4", "tiny", OPTS, "random ids", 96, 3)
    plan = kvslim.apply(calib_model, "int4", per_layer=kvslim.load_per_layer(path, calib_model, "int4"), **OPTS)
    try:
        assert [lp.factory(None).spec.rotation for lp in plan.layers] == [
            per_layer.get(i, {}).get("rotation") for i in range(3)]
    finally:
        kvslim.restore(calib_model)


def test_tensor_entries_round_trip_exactly(calib_model, tmp_path):
    scales = torch.rand(2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    per_layer = {0: {"rotation": None, "bits": 8}, 2: {"key_scales": scales, "rotation": "hadamard"},
                 1: {"key_scales": scales.float()[:, :8].t()}}  # a non-contiguous view
    back = kvslim.load_per_layer(kvslim.save_per_layer(tmp_path / "t.st", per_layer, calib_model, "turbo3"),
                                 calib_model)
    assert sorted(back) == [0, 1, 2] and back[0] == {"rotation": None, "bits": 8}
    for i in (1, 2):
        want = per_layer[i]["key_scales"]
        assert back[i]["key_scales"].dtype == want.dtype and torch.equal(back[i]["key_scales"], want)
    assert back[2]["rotation"] == "hadamard"


def test_turbo_key_scales_round_trip(calib_model, calib_ids, tmp_path):
    """``calibrate(model, ids, "turbo3")``'s key scales (nested lists) round trip exactly; saved as tensors they come
    back as tensors, and ``--per-layer-file``'s merge hands the plan the same floats as lists."""
    from kvslim.cli.method_options import with_per_layer_file

    turbo = dict(residual=8, flush=4, sink=2)
    per_layer = calibrate(calib_model, calib_ids, "turbo3", queries=32, **turbo)
    assert sorted(per_layer) == [0, 1, 2]
    path = kvslim.save_per_layer(tmp_path / "k.st", per_layer, calib_model, "turbo3", options=turbo)
    assert kvslim.load_per_layer(path, calib_model, "turbo3") == per_layer
    as_tensors = {i: {"key_scales": torch.tensor(o["key_scales"], dtype=torch.float64)} for i, o in per_layer.items()}
    path = kvslim.save_per_layer(tmp_path / "t.st", as_tensors, calib_model, "turbo3", options=turbo)
    back = kvslim.load_per_layer(path, calib_model, "turbo3")
    assert all(torch.equal(back[i]["key_scales"], as_tensors[i]["key_scales"]) for i in per_layer)
    opts = with_per_layer_file({"turbo3": dict(turbo)}, read_per_layer(path), calib_model, "tiny")["turbo3"]
    assert opts["per_layer"] == per_layer
    kvslim.apply(calib_model, "turbo3", **opts)
    kvslim.restore(calib_model)


def test_float_lists_are_float64_tensors_and_format_1_still_loads(calib_model, calib_ids, tmp_path):
    """Nested lists of floats (``calibrate``'s turbo key scales) go to the safetensors body as float64 tensors, marked
    so that they load back as the same lists (``==``, float for float), in a file smaller than the same dict with the
    lists in the JSON metadata (the /1 layout, written here by hand), which still loads."""
    from safetensors import safe_open

    scales = calibrate(calib_model, calib_ids, "turbo3", queries=32, residual=8, flush=4, sink=2)
    per_layer = {i: dict(o) for i, o in scales.items()}
    per_layer[1].update(mixed=[1, 2.5], ragged=[[1.5], [2.5, 3.5]], empty=[], one=1.5)  # these stay JSON
    path = kvslim.save_per_layer(tmp_path / "v2.st", per_layer, calib_model, "turbo3", name="tiny")
    back = kvslim.load_per_layer(path, calib_model, "turbo3")
    assert back == per_layer
    assert all(type(x) is float for o in back.values() for row in o["key_scales"] for x in row)
    assert type(back[1]["mixed"][0]) is int
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["kvslim"])
        assert sorted(f.keys()) == [f"layer.{i}.key_scales" for i in range(3)]
        assert all(f.get_tensor(k).dtype == torch.float64 for k in f.keys())
    assert meta["format"] == FORMAT == "kvslim.per_layer/3"
    assert meta["per_layer"]["1"]["mixed"] == {"json": [1, 2.5]} and meta["per_layer"]["1"]["one"] == {"json": 1.5}
    v1 = {**meta, "format": "kvslim.per_layer/1", "per_layer": {str(i): o for i, o in per_layer.items()}}
    save_file({}, str(tmp_path / "v1.st"), metadata={"kvslim": json.dumps(v1, sort_keys=True, allow_nan=False)})
    assert kvslim.load_per_layer(tmp_path / "v1.st", calib_model, "turbo3") == per_layer
    assert path.stat().st_size < (tmp_path / "v1.st").stat().st_size


def test_plain_dict_values_with_marker_keys_load_as_themselves(calib_model, tmp_path):
    """A plain dict value holding a ``__tensor__`` or ``__list__`` key (the /2 marks) is JSON, not a tensor entry:
    /3 tags every value. A /2 file (written by hand, tensor and list entries marked) still loads."""
    per_layer = {0: {"note": {"__tensor__": "layer.0.x", "__list__": "y"}, "tags": {"json": 1}},
                 1: {"key_scales": torch.ones(2, 16), "grid": [[1.0, 2.0]]}}
    path = kvslim.save_per_layer(tmp_path / "m.st", per_layer, calib_model, "turbo3", name="tiny")
    back = kvslim.load_per_layer(path, calib_model, "turbo3")
    assert back[0] == per_layer[0] and back[1]["grid"] == [[1.0, 2.0]]
    assert torch.equal(back[1]["key_scales"], per_layer[1]["key_scales"])
    tensors = {"layer.1.key_scales": torch.ones(2, 16), "layer.1.grid": torch.tensor([[1.0, 2.0]], dtype=torch.float64)}
    v2 = {"format": "kvslim.per_layer/2", "method": "turbo3", "options": {}, "model": "tiny",
          "config_hash": config_hash(calib_model), "num_layers": 3, "k_norms": None,
          "per_layer": {"0": {"rotation": "hadamard"}, "1": {"key_scales": {"__tensor__": "layer.1.key_scales"},
                                                               "grid": {"__list__": "layer.1.grid"}}}}
    save_file(tensors, str(tmp_path / "v2.st"), metadata={"kvslim": json.dumps(v2)})
    old = kvslim.load_per_layer(tmp_path / "v2.st", calib_model, "turbo3")
    assert old[0] == {"rotation": "hadamard"} and old[1]["grid"] == [[1.0, 2.0]]
    assert torch.equal(old[1]["key_scales"], torch.ones(2, 16))


def test_refusals_by_name(calib_model, tmp_path):
    path = kvslim.save_per_layer(tmp_path / "c.st", {1: {"rotation": "hadamard"}}, calib_model, "int4", name="tiny")
    with pytest.raises(FileNotFoundError, match="no calibration file .*missing.st"):
        kvslim.load_per_layer(tmp_path / "missing.st")
    (tmp_path / "junk.st").write_bytes(b"not a safetensors file at all")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "weights.st"))  # safetensors, but not ours
    for name in ("junk.st", "weights.st"):
        with pytest.raises(ValueError, match=f"{name}' is not a kvslim calibration file"):
            kvslim.load_per_layer(tmp_path / name)
    with pytest.raises(ValueError, match="calibrated for method 'int4', not 'int2'"):
        kvslim.load_per_layer(path, calib_model, "int2")
    other = tiny_model("llama", kv_heads=2, num_hidden_layers=2, attention_bias=True)
    with pytest.raises(ValueError, match="calibrated for model 'tiny' .*not this model"):
        kvslim.load_per_layer(path, other, "int4")
    same_shape = tiny_model("llama", kv_heads=2, num_hidden_layers=3, attention_bias=True, seed=1)
    with pytest.raises(ValueError, match="layer 0 k_proj weights differ .*other weights"):
        kvslim.load_per_layer(path, same_shape, "int4")
    assert kvslim.load_per_layer(path, copy.deepcopy(calib_model).to(torch.bfloat16).float(), "int4") == {
        1: {"rotation": "hadamard"}}
    # a hand-made file naming a layer the model does not have
    meta = json.loads(json.dumps({**read_per_layer(path).__dict__, "format": FORMAT}))
    meta["per_layer"] = {"7": {"rotation": {"json": "hadamard"}}}
    save_file({}, str(tmp_path / "edited.st"), metadata={"kvslim": json.dumps(meta)})
    with pytest.raises(ValueError, match=r"layer\(s\) \[7\] outside this model's 3 layers"):
        kvslim.load_per_layer(tmp_path / "edited.st", calib_model, "int4")
    # save: nothing written on bad input
    for bad, words in (({3: {"rotation": None}}, "layer 3 is outside the model's 3 layers"),
                       ({0: {"rotation": object()}}, "must hold JSON values"),
                       ({0: "hadamard"}, r"per_layer\[0\] must be a dict")):
        with pytest.raises(ValueError, match=words):
            kvslim.save_per_layer(tmp_path / "bad.st", bad, calib_model, "int4")
        assert not (tmp_path / "bad.st").exists()
    with pytest.raises(ValueError, match="path: .* is a folder"):
        kvslim.save_per_layer(tmp_path, {}, calib_model, "int4")


def _refused(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err


def test_cli_refusals_before_loading(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("kvslim.cli.eval.load_model", lambda *a: pytest.fail("model loaded"))
    out = str(tmp_path / "c.st")
    _refused(capsys, ["calibrate", "--model", "tiny-mha", "--method", "slim", "--out", out], "--method", "slim")
    _refused(capsys, ["calibrate", "--model", "tiny-mha", "--out", str(tmp_path / "no" / "c.st")], "--out",
             "no folder")
    _refused(capsys, ["calibrate", "--model", "tiny-mha", "--option", "int2.bits=4", "--out", out], "--option",
             "not in --method")
    _refused(capsys, ["eval", "--model", "tiny-mha", "--text", "botchan", "--per-layer-file", out],
             "--per-layer-file", "no calibration file")
    (tmp_path / "junk.st").write_text("junk")
    _refused(capsys, ["eval", "--model", "tiny-mha", "--text", "botchan", "--per-layer-file",
                      str(tmp_path / "junk.st")], "--per-layer-file", "not a kvslim calibration file")
    assert not (tmp_path / "c.st").exists()


def test_cli_calibrate_then_eval_demo_bench(capsys, tmp_path, monkeypatch):
    from kvslim.cli import eval as cli_eval

    seen, check_plans = [], cli_eval.check_plans
    monkeypatch.setattr(cli_eval, "check_plans", lambda m, methods, opts: (seen.append(opts), check_plans(m, methods,
                                                                                                         opts)))
    out = str(tmp_path / "tiny_int4.safetensors")
    assert main(["calibrate", "--model", "tiny-mha", "--tokens", "400", "--queries", "64", "--threads", "1",
                 "--option", "int4.residual=64", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "int4 calibrated on 400 tokens of botchan in" in printed and f"wrote {out}" in printed
    calib = read_per_layer(out)
    assert (calib.model, calib.method, calib.options, calib.text, calib.tokens) == (
        "tiny-mha", "int4", {"residual": 64}, "botchan", 400)
    assert calib.seconds > 0 and all(set(o) == {"rotation"} for o in calib.per_layer.values())
    assert ("no layer changed" in printed) == (not calib.per_layer)
    assert main(["eval", "--model", "tiny-mha", "--text", "botchan", "--tokens", "200", "--steps", "32",
                 "--methods", "int4", "--option", "int4.residual=64", "--per-layer-file", out]) == 0
    assert "int4" in capsys.readouterr().out
    assert seen[-1]["int4"] == {"residual": 64, "per_layer": calib.per_layer}  # what the eval's plans ran with
    _refused(capsys, ["eval", "--model", "tiny-mha", "--text", "botchan", "--methods", "int2", "--per-layer-file",
                      out], "--per-layer-file", "calibrated for method 'int4', which is not in --methods")
    _refused(capsys, ["demo", "--model", "tiny-mha", "--per-layer-file", out], "--per-layer-file",
             "not in the methods of this demo")
    _refused(capsys, ["bench", "--quick", "--per-layer-file", out], "--per-layer-file", "GPU table")
    _refused(capsys, ["bench", "--methods", "kvslim-int2", "--per-layer-file", out], "--per-layer-file",
             "not in the methods of --methods")


def test_demo_rows_and_bench_records_run_the_file(calib_model, tmp_path):
    """demo's rows (label names the file, options carry its dict) and bench's CPU records (its kinds' caches follow
    it; the record is JSON) on a tiny model, with the file's check against the loaded model."""
    import argparse

    from kvslim.bench.decode import make_filled_cache, measure_group
    from kvslim.cli.demo import file_options, with_options
    from kvslim.cli.method_options import with_per_layer_file

    per_layer = {0: {"rotation": "hadamard"}, 2: {"rotation": "hadamard"}}
    path = kvslim.save_per_layer(tmp_path / "c.st", per_layer, calib_model, "int4", name="tiny", options=OPTS)
    calib = read_per_layer(path)
    args = argparse.Namespace(options={"int4": dict(OPTS)}, calibration=calib, model="tiny")
    ((label, method, opts),) = with_options((("int4", "int4", {}),), file_options(args, calib_model))
    assert label == f"int4 residual=32,sink=2,key_channel_group=16,per_layer=<{path.name}>"
    assert opts == {**OPTS, "per_layer": per_layer}
    options = with_per_layer_file({"int4": {**OPTS, "per_layer": {2: {"rotation": None}}}}, calib, calib_model, "tiny")
    assert options["int4"]["per_layer"] == {0: {"rotation": "hadamard"}, 2: {"rotation": None}}  # --option wins
    cache = make_filled_cache(calib_model, "kvslim-int4", 1, 64, 2, {"int4": opts})
    kvslim.restore(calib_model)
    assert [layer.spec.rotation for layer in cache.layers] == ["hadamard", None, "hadamard"]
    (rec,) = measure_group(calib_model, "tiny", ["kvslim-int4"], 1, 64, 1, 1, 1.0, {"int4": opts})
    assert "skipped" not in rec and json.loads(json.dumps(rec))["options"]["per_layer"] == {
        "0": {"rotation": "hadamard"}, "2": {"rotation": "hadamard"}}


def test_bench_refuses_a_file_for_another_model_before_measuring_it(capsys, calib_model, tmp_path, monkeypatch):
    path = kvslim.save_per_layer(tmp_path / "c.st", {0: {"rotation": "hadamard"}}, calib_model, "int4", name="tiny")
    other = tiny_model("llama", kv_heads=2, num_hidden_layers=2)
    monkeypatch.setattr("kvslim.bench.roofline.measure_bandwidth",
                        lambda device: {"read_gbps": 1.0, "copy_gbps": 1.0, "roofline_gbps": 1.0})
    monkeypatch.setattr("kvslim.cli.bench.load_model", lambda name, dtype, device: other)
    monkeypatch.setattr("kvslim.bench.decode.measure_group", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["bench", "--models", "mha-100m", "--methods", "kvslim-int4", "--per-layer-file", str(path),
                      "--out", str(tmp_path / "out")], "--per-layer-file", "calibrated for model 'tiny'",
             "--models mha-100m")
    assert not (tmp_path / "out").exists()
