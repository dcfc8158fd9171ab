"""vllm-ascend's own view of a checkpoint layout, read off the NPU (run in a subprocess).

    python tests/vllm_ascend_peer.py fetch DIR     # the pinned sdist into DIR (install step)
    python tests/vllm_ascend_peer.py ask ROOT REQUEST.json ANSWER.json

`ask` imports vllm-ascend 0.23.0.post1's scheme modules from ROOT (a folder holding the
sdist's `vllm_ascend/` package, never installed), lets its scheme classes declare the
parameters of each Linear in the request, the way its `AscendLinearMethod.create_weights`
asks them, and lets its `AscendModelSlimConfig` read each checkpoint folder the way vLLM's
`get_quant_config` + `maybe_update_config` hand it over. Nothing of vllm-ascend is copied
here. Off the NPU it needs the stand-ins of `install_stand_ins`, each listed in the answer.

A subprocess because the stand-ins (a fake `torch_npu`, vllm-ascend's registration of the
`ascend` quantization name) must not leak into the test session's own vLLM.
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
import types
import urllib.request
from pathlib import Path

VERSION = "0.23.0.post1"
SDIST = f"vllm_ascend-{VERSION}.tar.gz"
# PyPI publishes 0.23.0.post1 as an sdist only, and `pip download` of an sdist builds its
# metadata, which for vllm-ascend needs torch-npu, CANN and CMake: fetch the file itself.
SDIST_URL = ("https://files.pythonhosted.org/packages/ab/7a/"
             "32a1b1f13467fb7372588206fa1ffb735f28dcd8504d562f5c7ccdbd90d0/" + SDIST)
SDIST_SHA256 = "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"


def fetch(folder: Path) -> Path:
    """Download the pinned sdist into `folder` (kept if already there and intact)."""
    folder.mkdir(parents=True, exist_ok=True)
    dst = folder / SDIST
    if not dst.is_file() or hashlib.sha256(dst.read_bytes()).hexdigest() != SDIST_SHA256:
        data = urllib.request.urlopen(SDIST_URL, timeout=120).read()
        digest = hashlib.sha256(data).hexdigest()
        if digest != SDIST_SHA256:
            raise SystemExit(f"{SDIST_URL}: sha256 {digest}, expected {SDIST_SHA256}")
        dst.write_bytes(data)
    return dst


def install_stand_ins(root: Path) -> list[str]:
    """Make vllm-ascend's scheme modules importable on a CPU; returns what was stood in."""
    # vLLM and transformers probe importlib.util.find_spec("torch_npu") when first imported;
    # a module object without a spec makes that probe raise, so they go first, on a machine
    # that (truly) has no torch_npu.
    import accelerate  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.distributed  # noqa: F401
    import vllm.model_executor.layers.linear  # noqa: F401

    from ascend_quant.runtime.kernels import npu_emulation

    sys.path.insert(0, str(root))
    done = []
    sys.modules["torch_npu"] = npu_emulation.module()
    done.append("torch_npu: ascend_quant.runtime.kernels.npu_emulation (imported at module level; "
                "no op is called here)")
    # Package __init__s that import every scheme and vllm-ascend's MoE layers, written against
    # vLLM 0.23 (`FusedMoE` in fused_moe.layer, gone in the installed vLLM): bare packages over
    # the real folders, so each submodule still imports its own code.
    for name in ("vllm_ascend.quantization.methods", "vllm_ascend.ops", "vllm_ascend.ops.fused_moe"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = pkg
        done.append(f"{name}: package without its __init__.py (it imports every MoE op)")
    # MoE routing, imported by w8a8_dynamic.py and w4a8.py for their MoE classes only; its
    # real module needs vllm_ascend/_build_info.py, which the CMake/CANN build writes.
    selector = types.ModuleType("vllm_ascend.ops.fused_moe.experts_selector")

    def moe_only(*args, **kwargs):
        raise RuntimeError("MoE expert selection is not available off the NPU")

    selector.select_experts = selector.zero_experts_compute = moe_only
    sys.modules[selector.__name__] = selector
    done.append("vllm_ascend.ops.fused_moe.experts_selector: select_experts/zero_experts_compute "
                "that raise (MoE only)")
    from vllm_ascend.quantization.methods import registry
    sys.modules["vllm_ascend.quantization.methods"].get_scheme_class = registry.get_scheme_class
    for scheme in ("w8a8_static", "w8a8_dynamic", "w8a16", "w4a8"):
        __import__(f"vllm_ascend.quantization.methods.{scheme}")
    w4a8 = sys.modules["vllm_ascend.quantization.methods.w4a8"]
    w4a8.get_tensor_model_parallel_world_size = lambda: 1
    done.append("w4a8.get_tensor_model_parallel_world_size: 1 (one device, no process group)")
    return done


def declared_params(quant_type: str, n: int, k: int, params_dtype, row: bool, description: dict) -> dict:
    """name -> {dtype, shape, kind, packed} as vllm-ascend's linear scheme declares them for a
    Linear of `n` outputs and `k` inputs (one device: the partition is the whole Linear)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_ascend.quantization.methods.registry import get_scheme_class
    from vllm_ascend.quantization.modelslim_config import AscendModelSlimConfig

    cls = get_scheme_class(quant_type, "linear")
    if cls is None:
        return {"error": f"no ({quant_type!r}, 'linear') scheme registered"}
    cfg = VllmConfig()
    cfg.quant_config = AscendModelSlimConfig(dict(description))
    layer_type = "row" if row else "others"
    with set_current_vllm_config(cfg):
        scheme = cls()
        out = {}
        weights = scheme.get_weight(k, n, params_dtype)
        packed = (weights.pop("_packed_dim", None), weights.pop("_packed_factor", None))
        groups = [("weight", weights),
                  ("pertensor", scheme.get_pertensor_param(params_dtype, layer_type=layer_type)),
                  ("perchannel", scheme.get_perchannel_param(n, params_dtype)),
                  ("pergroup", scheme.get_pergroup_param(k, n, params_dtype, layer_type=layer_type))]
        for kind, params in groups:
            for name, t in params.items():
                if name.startswith("_packed"):      # loader hints, not parameters
                    continue
                out[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "kind": kind,
                             "packed": list(packed) if kind == "weight" and packed[0] is not None else None}
    return {"class": cls.__name__, "params": out}


# config.json's model_type -> the vLLM model class whose packed_modules_mapping vLLM hands the
# quant config (vllm-ascend replaces it only for the model types its own table lists)
MODEL_CLASSES = {"qwen2": ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM"),
                 "glm4": ("vllm.model_executor.models.glm4", "Glm4ForCausalLM")}


def read_folder(path: str, prefixes: list[str]) -> dict:
    """What vllm-ascend's config makes of a checkpoint folder: the description keys it holds
    and, per vLLM Linear prefix (fused names: qkv_proj, gate_up_proj), the scheme it picks,
    with the packed mapping of the folder's model type (Qwen2's without a config.json)."""
    import importlib

    from vllm_ascend.quantization.modelslim_config import (AscendModelSlimConfig, create_scheme_for_layer,
                                                           packed_modules_model_mapping)

    config = json.loads((Path(path) / "config.json").read_text())
    model_type = config.get("model_type", "qwen2")
    module, cls = MODEL_CLASSES[model_type]
    hf_quant = config.get("quantization_config")
    # vLLM's get_quant_config: from_config(config.json's quantization_config) when there is one,
    # else the class's default (vllm-ascend lists no config file names); then maybe_update_config.
    qc = AscendModelSlimConfig.from_config(hf_quant) if hf_quant is not None else AscendModelSlimConfig()
    qc.maybe_update_config(path)
    from vllm.config import VllmConfig, set_current_vllm_config

    mapping = dict(packed_modules_model_mapping.get(model_type)
                   or getattr(importlib.import_module(module), cls).packed_modules_mapping)
    layers = {}
    vllm_config = VllmConfig()          # some schemes (W4A8) read the current config when built
    vllm_config.quant_config = qc
    with set_current_vllm_config(vllm_config):
        _pick_schemes(qc, prefixes, mapping, layers, create_scheme_for_layer)
    return {"description_keys": len(qc.quant_description), "layers": layers}


def _pick_schemes(qc, prefixes, mapping, layers, create_scheme_for_layer) -> None:
    for prefix in prefixes:
        try:
            if qc.is_layer_skipped_ascend(prefix, mapping):
                layers[prefix] = "FLOAT"
            else:
                scheme = create_scheme_for_layer(qc.quant_description, prefix, "linear", mapping)
                layers[prefix] = type(scheme).__name__
        except Exception as e:
            layers[prefix] = f"error: {type(e).__name__}: {e}"


def ask(root: Path, request: dict) -> dict:
    import torch

    answer = {"version": VERSION, "stand_ins": install_stand_ins(root), "linears": {}, "folders": {}}
    for case in request.get("linears", []):
        try:
            answer["linears"][case["id"]] = declared_params(
                case["quant_type"], case["n"], case["k"], getattr(torch, case["params_dtype"]),
                case.get("row", False), case.get("description", {}))
        except Exception as e:
            answer["linears"][case["id"]] = {"error": f"{type(e).__name__}: {e}"}
    for folder in request.get("folders", []):
        try:
            answer["folders"][folder["path"]] = read_folder(folder["path"], folder["prefixes"])
        except Exception:
            answer["folders"][folder["path"]] = {"error": traceback.format_exc(limit=3)}
    return answer


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "fetch":
        print(fetch(Path(sys.argv[2])))
    elif len(sys.argv) == 5 and sys.argv[1] == "ask":
        result = ask(Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()))
        Path(sys.argv[4]).write_text(json.dumps(result, indent=1) + "\n")   # stdout carries vLLM's logs
    else:
        raise SystemExit(__doc__)
