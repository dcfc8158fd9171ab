"""`verify` passes msModelSlim's files and names each problem of broken copies in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ascend_quant import numerics
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


# ------------------------------------------------------------------------ bad tensor values

def _edit_tensor(folder, name, edit):
    """Rewrite one tensor of a copied fixture (whichever file holds it); returns that file's name."""
    from ascend_quant.formats.ascend import read_checkpoint

    file = read_checkpoint(folder).tensor_files[name]
    tensors = load_file(file)
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, str(file))
    return file.name


def _set_first(value):
    def edit(t):
        if t.dtype == torch.int64:        # deq_scale as msModelSlim stores it for fp16: float32 bits in int64
            f = numerics.decode_deq_scale(t)
            f.reshape(-1)[0] = value
            return numerics.encode_deq_scale(f, torch.float16)
        t.reshape(-1)[0] = value
        return t
    return edit


def _rejected_naming(folder, file, name, *fragments):
    """verify fails with exactly one value line for `name`, which starts with its file."""
    report = verify(folder)
    assert not report.ok
    lines = [p for p in report.problems if p.startswith(f"{file}: {name} has ")]
    assert len(lines) == 1, report.problems
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


SCALES = [("v1_w8a8_dyn", "model.layers.0.mlp.gate_proj.weight_scale"),            # W8A8_DYNAMIC
          ("v1_w8a16_w4a8", "model.layers.0.self_attn.o_proj.weight_scale"),       # W8A16
          ("v1_w8a16_w4a8", "model.layers.1.mlp.down_proj.weight_scale"),          # W4A8_DYNAMIC per-channel
          ("v0_w4a8", "model.layers.0.self_attn.q_proj.weight_scale"),             # W4A8 two-stage, stage 1
          ("v0_w4a8", "model.layers.1.mlp.up_proj.weight_scale_second"),           # W4A8 two-stage, stage 2
          ("v0_w4a16", "model.layers.0.self_attn.v_proj.weight_scale"),            # W4A16 per-group
          ("v0_w8a8", "model.layers.0.self_attn.k_proj.weight_scale"),             # v0 W8A8 keeps it too
          ("v1_w8a8_static_c8", "model.layers.1.mlp.down_proj.input_scale"),       # W8A8 static
          ("v1_w8a8_static_c8", "model.layers.0.self_attn.q_proj.deq_scale"),      # int64-encoded
          ("v0_w8a8", "model.layers.1.mlp.up_proj.deq_scale"),
          ("v1_w8a8_static_c8", "model.layers.0.self_attn.k_proj.kv_cache_scale"),  # C8
          ("v1_w8a8_static_c8", "model.layers.1.self_attn.v_proj.kv_cache_scale")]
BAD_SCALES = [(float("nan"), "1 NaN"), (float("inf"), "1 Inf"), (0.0, "1 zero"), (-0.25, "1 negative"),
              (float("-inf"), "1 Inf, 1 negative")]


@pytest.mark.parametrize("value,what", BAD_SCALES, ids=["nan", "inf", "zero", "negative", "-inf"])
@pytest.mark.parametrize("fixture,name", SCALES, ids=[n.split(".", 3)[-1] + "@" + f for f, n in SCALES])
def test_bad_scale_is_one_line_naming_file_and_tensor(golden_copy, fixture, name, value, what):
    d = golden_copy(fixture)
    file = _edit_tensor(d, name, _set_first(value))
    _rejected_naming(d, file, name, what, "must be finite and > 0")


def test_float32_deq_scale_is_checked_too(golden_copy):
    """bf16 checkpoints store deq_scale as float32: the same rule, without the decoding."""
    d = golden_copy("v1_w8a8_static_c8")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    for proj in ("q", "k", "v", "o", "gate", "up", "down"):
        for layer in (0, 1):
            part = "self_attn" if len(proj) == 1 else "mlp"
            _edit_tensor(d, f"model.layers.{layer}.{part}.{proj}_proj.deq_scale", numerics.decode_deq_scale)
    assert verify(d).ok
    name = "model.layers.0.mlp.gate_proj.deq_scale"
    file = _edit_tensor(d, name, _set_first(-1.0))
    assert verify(d).problems == [f"{file}: {name} has 1 negative value(s) of 256 (first at [0]: -1.0); "
                                  "a W8A8 deq_scale must be finite and > 0"]


def test_int64_deq_scale_with_bits_above_float32(golden_copy):
    d = golden_copy("v0_w8a8")
    name = "model.layers.0.self_attn.o_proj.deq_scale"
    file = _edit_tensor(d, name, lambda t: t.index_fill_(0, torch.tensor([3]), 1 << 40))
    _rejected_naming(d, file, name, "1 non-float32", "float32 scale")


@pytest.mark.parametrize("fixture,name,value,what", [
    ("v1_w8a8_static_c8", "model.layers.0.mlp.up_proj.input_offset", float("nan"), "1 NaN"),
    ("v1_w8a8_static_c8", "model.layers.0.mlp.up_proj.input_offset", 0.5, "1 non-integral"),
    ("v0_w8a8", "model.layers.1.self_attn.q_proj.input_offset", 200.0, "1 out-of-range"),
    ("v1_w8a8_dyn", "model.layers.1.mlp.down_proj.weight_offset", float("inf"), "1 Inf"),
    ("v0_w4a8", "model.layers.0.mlp.gate_proj.weight_offset", float("nan"), "1 NaN"),
    ("v1_w8a16_w4a8", "model.layers.0.mlp.gate_proj.scale_bias", float("nan"), "1 NaN"),
    ("v0_w4a8", "model.layers.1.self_attn.o_proj.scale_bias", float("-inf"), "1 Inf"),
    ("v1_w8a8_static_c8", "model.layers.1.self_attn.k_proj.kv_cache_offset", float("nan"), "1 NaN"),
    ("v1_w8a8_dyn", "model.embed_tokens.weight", float("nan"), "1 NaN"),        # FLOAT tensors
    ("v0_w4a16", "lm_head.weight", float("inf"), "1 Inf"),
    ("v1_w8a16_w4a8", "model.norm.weight", float("nan"), "1 NaN"),
    ("v0_w8a8", "model.layers.0.self_attn.q_proj.bias", float("-inf"), "1 Inf"),
])
def test_non_finite_offsets_biases_and_float_tensors(golden_copy, fixture, name, value, what):
    d = golden_copy(fixture)
    file = _edit_tensor(d, name, _set_first(value))
    _rejected_naming(d, file, name, what)


def test_float_quant_bias_is_refused(golden_copy):
    d = golden_copy("v1_w8a8_static_c8")
    name = "model.layers.0.self_attn.v_proj.quant_bias"
    file = _edit_tensor(d, name, lambda t: t.float())
    _one_problem(d, f"{file}: {name} is float32", "needs int32")


@pytest.mark.parametrize("fixture,name", [("v1_w8a16_w4a8", "model.layers.0.mlp.down_proj.weight"),
                                          ("v0_w4a8", "model.layers.1.self_attn.k_proj.weight"),
                                          ("v0_w4a16", "model.layers.0.mlp.up_proj.weight")])
def test_packed_int4_weight_of_the_wrong_shape(golden_copy, fixture, name):
    """Same bytes, another shape: the header stays valid, the packing along n does not."""
    d = golden_copy(fixture)
    file = _edit_tensor(d, name, lambda t: t.reshape(t.shape[0] * 2, t.shape[1] // 2).clone())
    report = verify(d)
    lines = [p for p in report.problems if p.startswith(f"{file}: {name} holds packed int4")]
    assert len(lines) == 1 and "two int4 per byte along n" in lines[0], report.problems


def test_cli_verify_names_a_nan_scale(golden_copy):
    d = golden_copy("v1_w8a8_dyn")
    name = "model.layers.1.self_attn.q_proj.weight_scale"
    _edit_tensor(d, name, _set_first(float("nan")))
    r = CliRunner().invoke(cli, ["verify", str(d)])
    assert r.exit_code == 1
    assert r.stderr.splitlines() == [f"error: quant_model_weights.safetensors: {name} has 1 NaN value(s) of 128 "
                                     f"(first at [0, 0]: nan); a W8A8_DYNAMIC weight_scale must be finite and > 0"]


# ------------------------------------------------------------------------ malformed JSON

@pytest.mark.parametrize("content,what", [("[1, 2]", "found a list"), ("42", "found a number"), ("", "not valid JSON"),
                                          ('{"weight_map": [1]}', "no 'weight_map' object"),
                                          ('{"weight_map": {"a": 3}}', "not a *.safetensors file name"),
                                          ('{"weight_map": {"a": "../x.safetensors"}}', "not a *.safetensors"),
                                          ('{"weight_map": {"a": "gone.safetensors"}}', "do not exist: gone")])
def test_bad_shard_index_is_one_line(golden_copy, content, what):
    d = golden_copy("v1_w8a8_static_c8")
    (d / "quant_model_weights.safetensors.index.json").write_text(content)
    report = verify(d)
    assert len(report.problems) == 1 and what in report.problems[0], report.problems
    assert "quant_model_weights.safetensors.index.json" in report.problems[0]


def test_index_that_disagrees_with_the_shards(golden_copy):
    d = golden_copy("v1_w8a8_static_c8")
    index = d / "quant_model_weights.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = "quant_model_weights-00001-of-00001.safetensors"
    del data["weight_map"]["model.norm.weight"]
    data["weight_map"]["model.layers.0.mlp.up_proj.weight_scale"] = shard
    index.write_text(json.dumps(data))
    _one_problem(d, "'model.norm.weight'", "missing from weight_map")
    _one_problem(d, "weight_map lists 'model.layers.0.mlp.up_proj.weight_scale'", "which no shard holds")


@pytest.mark.parametrize("key,value,what", [("group_size", "64", "'group_size' is '64'; expected int"),
                                            ("group_size", -1, "expected 0 (per-channel)"),
                                            ("metadata", [], "'metadata' is []; expected dict"),
                                            ("model_quant_type", 8, "expected str")])
def test_bad_top_level_description_values(golden_copy, key, value, what):
    d = golden_copy("v0_w4a8")
    desc = json.loads((d / "quant_model_description.json").read_text())
    desc[key] = value
    (d / "quant_model_description.json").write_text(json.dumps(desc))
    report = verify(d)
    assert len(report.problems) == 1 and what in report.problems[0], report.problems


@pytest.mark.parametrize("edit,what", [(lambda c: [c], "found a list"), (lambda c: {**c, "num_attention_heads": 0},
                                                                           "expected a positive integer"),
                                       (lambda c: {**c, "num_hidden_layers": "2"}, "'num_hidden_layers' is '2'"),
                                       (lambda c: {**c, "text_config": 3}, "'text_config' is a number")])
def test_bad_config_json_is_one_line(golden_copy, edit, what):
    d = golden_copy("v1_w8a8_dyn")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(cfg)))
    report = verify(d)
    assert len(report.problems) == 1 and what in report.problems[0] and "config.json" in report.problems[0]


def test_many_missing_layers_are_one_line(golden_copy):
    """config.json promising a million layers does not make verify print (or loop over) a million."""
    d = golden_copy("v1_w8a8_dyn")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 10 ** 6
    (d / "config.json").write_text(json.dumps(cfg))
    hits = _one_problem(d, "no keys for 999998 of 1000000 layers (first: 2, 3, 4)")
    assert len(hits) == 1


# ------------------------------------------------------------------------ --json is one document

@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_json_output_is_one_document_on_stdout(command, golden_copy):
    """The installed command in a fresh process: stdout parses as exactly one JSON document
    (nothing logged before or after it), for a good and for a broken folder."""
    import subprocess
    import sys

    broken = golden_copy("v1_w8a8_dyn")
    _edit_tensor(broken, "model.layers.0.mlp.up_proj.weight_scale", _set_first(0.0))
    for folder, ok in ((fixture_dir("v1_w8a8_static_c8"), True), (broken, command == "inspect")):
        r = subprocess.run([sys.executable, "-m", "ascend_quant.cli.main", command, "--json", str(folder)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == (0 if ok else 1), r.stderr
        doc, end = json.JSONDecoder().raw_decode(r.stdout)
        assert r.stdout[end:].strip() == "" and isinstance(doc, dict)
        assert "Traceback" not in r.stderr
        if command == "verify":
            assert doc["ok"] is ok
