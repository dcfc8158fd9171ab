"""`verify` passes msModelSlim's files and names each problem of broken copies in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ascend_quant.cli.main import cli
from ascend_quant.formats.verify import verify
from conftest import GOLDEN, fixture_dir


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_folders_pass(name):
    report = verify(fixture_dir(name))
    assert report.ok, report.problems
    if name.startswith("v0"):
        assert any("no config.json" in n for n in report.notes)


def _rewrite(folder, edit):
    f = folder / "quant_model_weights.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, str(f))


def _one_problem(folder, *fragments):
    report = verify(folder)
    assert not report.ok
    hits = [p for p in report.problems if all(fr in p for fr in fragments)]
    assert hits, report.problems
    assert all("\n" not in p for p in report.problems)
    return hits


def test_removed_description_key(golden_copy):
    d = golden_copy("v1_w8a8_dyn")
    desc = json.loads((d / "quant_model_description.json").read_text())
    del desc["model.layers.1.mlp.down_proj.weight"]
    (d / "quant_model_description.json").write_text(json.dumps(desc))
    _one_problem(d, "model.layers.1.mlp.down_proj.weight", "KeyError")
    _one_problem(d, "layer 1 has no key 'model.layers.1.mlp.down_proj.weight'")


def test_removed_tensor_and_key(golden_copy):
    d = golden_copy("v1_w8a8_dyn")
    _rewrite(d, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale"))
    _one_problem(d, "model.layers.0.self_attn.k_proj.weight_scale", "no weight file holds it")
    _one_problem(d, "no 'weight_scale' tensor")


def test_truncated_safetensors(golden_copy):
    d = golden_copy("v1_w8a16_w4a8")
    f = d / "quant_model_weights.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _one_problem(d, "quant_model_weights.safetensors", "truncated")


def test_truncated_shard_of_an_index(golden_copy):
    d = golden_copy("v1_w8a8_static_c8")
    f = d / "quant_model_weights-00001-of-00001.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    _one_problem(d, "quant_model_weights-00001-of-00001.safetensors", "corrupt or truncated")


def test_wrong_dtype(golden_copy):
    d = golden_copy("v1_w8a8_dyn")
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight",
                                        t["model.layers.0.mlp.up_proj.weight"].float()))
    _one_problem(d, "model.layers.0.mlp.up_proj.weight is float32", "needs int8")


def test_deq_scale_dtype_must_match_config(golden_copy):
    d = golden_copy("v1_w8a8_static_c8")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    hits = _one_problem(d, "deq_scale is int64", "bfloat16", "float32")
    assert len(hits) == 14       # every W8A8 Linear of both layers


def test_float_model_left_beside(golden_copy):
    d = golden_copy("v1_w8a8_dyn")
    (d / "model.safetensors").write_bytes((fixture_dir("tiny-qwen2-fp32") / "model.safetensors").read_bytes())
    _one_problem(d, "model.safetensors", "stray")


def test_mismatched_qkv_input_scales(golden_copy):
    d = golden_copy("v1_w8a8_static_c8")
    f = d / "quant_model_weights-00001-of-00001.safetensors"
    t = load_file(f)
    t["model.layers.0.self_attn.v_proj.input_scale"] = t["model.layers.0.self_attn.v_proj.input_scale"] * 1.5
    save_file(t, str(f))
    _one_problem(d, "fused layers have different input_scale", "v_proj=")


def test_mismatched_fused_schemes(golden_copy):
    d = golden_copy("v1_w8a16_w4a8")
    desc = json.loads((d / "quant_model_description.json").read_text())
    desc["model.layers.0.self_attn.k_proj.weight"] = "W8A8_DYNAMIC"
    (d / "quant_model_description.json").write_text(json.dumps(desc))
    _one_problem(d, "fused layers disagree in scheme", "k_proj=W8A8_DYNAMIC")


def test_kv_scale_shape(golden_copy):
    d = golden_copy("v1_w8a8_static_c8")
    f = d / "quant_model_weights-00001-of-00001.safetensors"
    t = load_file(f)
    t["model.layers.1.self_attn.v_proj.kv_cache_scale"] = t["model.layers.1.self_attn.v_proj.kv_cache_scale"][:32].clone()
    save_file(t, str(f))
    _one_problem(d, "v_proj.kv_cache_scale", "[32]", "float32 [64]")


def test_unknown_quant_type(golden_copy):
    d = golden_copy("v1_w8a8_dyn")
    desc = json.loads((d / "quant_model_description.json").read_text())
    desc["model.layers.0.mlp.up_proj.weight"] = "W2A2"
    (d / "quant_model_description.json").write_text(json.dumps(desc))
    _one_problem(d, "unknown quant type 'W2A2'")


def test_asymmetric_w8a16_is_rejected(golden_copy):
    d = golden_copy("v1_w8a16_w4a8")
    _rewrite(d, lambda t: t["model.layers.0.self_attn.o_proj.weight_offset"].fill_(1.0))
    _one_problem(d, "o_proj.weight_offset is not zero")


# ------------------------------------------------------------------------ CLI

def test_cli_verify_exit_codes_and_json(golden_copy):
    runner = CliRunner()
    ok = runner.invoke(cli, ["verify", str(fixture_dir("v1_w8a8_static_c8"))])
    assert ok.exit_code == 0 and "ok:" in ok.output
    d = golden_copy("v1_w8a8_dyn")
    (d / "model.safetensors").write_bytes(b"x" * 10)
    bad = runner.invoke(cli, ["verify", str(d)])
    assert bad.exit_code == 1 and "error: model.safetensors: stray" in bad.output
    js = runner.invoke(cli, ["verify", "--json", str(d)])
    assert js.exit_code == 1 and json.loads(js.output)["ok"] is False
    missing = runner.invoke(cli, ["verify", str(d / "nope")])
    assert missing.exit_code == 1 and "no such folder" in missing.output


def test_cli_inspect_table_and_json():
    runner = CliRunner()
    res = runner.invoke(cli, ["inspect", str(fixture_dir("v1_w8a16_w4a8"))])
    assert res.exit_code == 0, res.output
    assert "model.layers.1.mlp.down_proj" in res.output and "W4A8_DYNAMIC" in res.output
    js = json.loads(runner.invoke(cli, ["inspect", "--json", str(fixture_dir("v1_w8a8_static_c8"))]).output)
    assert js["kv_cache"] == "int8 (C8)"
    rows = {r["module"]: r for r in js["modules"]}
    down = rows["model.layers.0.mlp.down_proj"]
    assert down["scheme"] == "W8A8" and down["shape"] == [128, 256]
    # int8 weight + deq_scale (int64) + quant_bias + two scalars, against 4 bytes per float weight
    assert down["bytes"] == 128 * 256 + 128 * 8 + 128 * 4 + 4 + 4
    assert down["float_bytes"] == 128 * 256 * 4
    t = js["totals"]
    assert t["quantized_linears"] == 14 and 0.25 < t["quantized_linear_bytes"] / t["quantized_linear_float_bytes"] < 0.3


def test_cli_inspect_bad_folder(tmp_path):
    res = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "Error:" in res.output
