"""Read and write the compressed-tensors layout (llm-compressor's output, vLLM's
`compressed-tensors` method), as far as `ascend-quant convert` needs it.

Conventions (from the `compressed-tensors` 0.17 sources and vLLM 0.32's loader):

* `config.json` carries `quantization_config`: `quant_method: "compressed-tensors"`,
  `format` (global: `int-quantized`, `pack-quantized`, `naive-quantized`,
  `float-quantized`, `dense`, or `mixed-precision` when groups differ, each group then
  carrying its own `format`), `config_groups` (name -> {targets, weights,
  input_activations, output_activations, format}; a group whose value is a list of
  targets names a preset scheme), `ignore` (module names, `re:` regexes or class names
  left unquantized), `kv_cache_scheme` (QuantizationArgs of K/V or null).
* Targets and ignore entries match a module when equal to its name, when a `re:` regex
  matches from its start (`re.match`), or when they name its class (`Linear`).
* QuantizationArgs: `num_bits`, `type` (int/float), `symmetric`, `strategy` (tensor,
  channel, group, token, block, attn_head, tensor_group; inferred from `group_size` when
  absent: none -> tensor, > 0 -> group, -1 -> channel), `group_size`, `dynamic`
  (true/false/"local"), `actorder`.
* Tensors per Linear `L`: `L.weight` (int8 values, int-/naive-quantized) or
  `L.weight_packed` int32 + `L.weight_shape` int64 [2] (pack-quantized);
  `L.weight_scale` ([1] tensor, [n,1] channel, [n,k/g] group), `L.weight_zero_point`
  (asymmetric only; packed along n for pack-quantized), `L.weight_g_idx` (actorder group),
  `L.input_scale` / `L.input_zero_point` [1] (static activations), `L.bias`.
  Quantize: `q = clamp(round(x / s + zp))`; dequantize: `(q - zp) * s`.
* Packing (pack-quantized): values are shifted to unsigned by `2^(b-1)` and packed along
  the in-features k, `32 // b` per int32 word, element i of a word in bits `[b*i, b*i+b)`;
  k is zero-padded to a whole word (`weight_shape` keeps the true shape).
* KV cache: `<attn>.k_scale`, `<attn>.v_scale` on the attention module
  (`model.layers.N.self_attn`), [1] for strategy tensor, [num_kv_heads, 1, 1] for attn_head.

MoE (llm-compressor with transformers 5 "linearizes" fused experts into one Linear per
expert and projection before quantizing, and saves them so; vLLM 0.32's
`compressed_tensors_moe`):

* Routed experts are per-expert Linears with the dense tensors above:
  `model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.<suffix>`. The linearized expert
  always names its Linears gate/up/down (`LINEARIZED_EXPERT_LINEARS`), so Mixtral's are
  `block_sparse_moe.experts.E.gate_proj` there (vLLM's Mixtral maps them to w1/w3/w2; the
  original checkpoint's w1/w3/w2 load too).
* `config_groups` usually target the class `Linear`; the recipe's ignore patterns
  (`re:.*mlp.gate$`, `re:.*shared_expert_gate$`) keep the router and Qwen2-MoE's shared-expert
  gate float, and the saved `ignore` lists the unquantized Linears by their names in memory
  (Mixtral `mlp.gate`, while its tensors sit under `block_sparse_moe`). DeepSeek's
  `mlp.gate.e_score_correction_bias` is a plain float tensor.
* vLLM resolves a layer's expert scheme from expert 0's gate/up/down names only (they must
  agree) and loads every expert into one `w13_*` / `w2_*` tensor per suffix. MoE methods:
  int8 channel weights + dynamic per-token int8 inputs (int-quantized) -> W8A8 int8 MoE;
  4/8-bit group or channel weight-only, pack-quantized only -> WNA16 MoE; 4-bit channel or
  group weights stored one value per int8 (int-quantized) + dynamic per-token int8 inputs ->
  W4A8 int8 MoE (Arm CPUs only). Static input scales are refused for int8 experts.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open

from ascend_quant.formats.ascend import (TensorInfo, _ST_DTYPES, load_json_object, shard_index_files,
                                         write_weights_folder)

QUANT_METHOD = "compressed-tensors"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
INT_QUANTIZED = "int-quantized"
PACK_QUANTIZED = "pack-quantized"
NAIVE_QUANTIZED = "naive-quantized"
FLOAT_QUANTIZED = "float-quantized"
MIXED = "mixed-precision"
# tensors a quantized Linear may carry besides its float bias
QUANT_SUFFIXES = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                  "weight_g_idx", "weight_global_scale", "input_scale", "input_zero_point",
                  "input_global_scale", "output_scale", "output_zero_point")
# the Linear names of one expert as llm-compressor's linearized experts write them (gate, up, down)
LINEARIZED_EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")
KV_SUFFIXES = ("k_scale", "v_scale", "k_zero_point", "v_zero_point", "q_scale", "q_zero_point")


class CompressedTensorsError(Exception):
    """A folder that is not a readable compressed-tensors checkpoint; the message names file and key."""


# --------------------------------------------------------------------------- args

@dataclass(frozen=True)
class QArgs:
    """compressed-tensors QuantizationArgs, with its defaults and strategy inference."""
    num_bits: int = 8
    type: str = "int"
    symmetric: bool = True
    strategy: str = "tensor"
    group_size: int | None = None
    dynamic: bool | str = False
    actorder: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "QArgs | None":
        if d is None:
            return None
        group_size = d.get("group_size")
        strategy = d.get("strategy")
        if strategy is None:
            strategy = ("tensor" if group_size is None else "group" if group_size > 0
                        else "channel" if group_size == -1 else "tensor")
        dynamic = d.get("dynamic", False)
        return cls(int(d.get("num_bits", 8)), str(d.get("type", "int")), bool(d.get("symmetric", True)),
                   str(strategy), group_size, dynamic, d.get("actorder"))

    def to_dict(self) -> dict:
        return {"num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
                "strategy": self.strategy, "group_size": self.group_size, "dynamic": self.dynamic,
                "actorder": self.actorder, "block_structure": None, "observer": None,
                "observer_kwargs": {}}


@dataclass
class Group:
    name: str
    targets: list[str]
    weights: QArgs | None
    input_activations: QArgs | None
    output_activations: QArgs | None
    format: str


def _preset(name: str, targets: list[str]) -> dict:
    """A preset scheme (`config_groups: {"W4A16": ["Linear"]}`) as a plain dict, from the library."""
    try:
        from compressed_tensors.quantization import preset_name_to_scheme
    except ImportError:
        raise CompressedTensorsError(f"config group {name!r} names a preset scheme; install compressed-tensors "
                                     "to expand it") from None
    try:
        return preset_name_to_scheme(name, targets).model_dump()
    except KeyError as e:
        raise CompressedTensorsError(str(e)) from None


def match(name: str, targets: list[str]) -> bool:
    """compressed-tensors' name matching: exact, `re:` regex from the start, or a class name
    (any target without a dot that is not a regex is taken as a class such as `Linear`)."""
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], name):
                return True
        elif t == name:
            return True
    return False


def _class_target(targets: list[str]) -> bool:
    return any(not t.startswith("re:") and "." not in t and t[:1].isupper() for t in targets)


# ---------------------------------------------------------------------- checkpoint

@dataclass
class CTCheckpoint:
    path: Path
    config: dict
    qconfig: dict
    groups: list[Group]
    ignore: list[str]
    kv_cache_scheme: QArgs | None
    format: str
    weight_files: list[Path]
    tensor_files: dict[str, Path]
    infos: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def config_file(self) -> str:
        return "config.json"

    def file_of(self, name: str) -> str:
        f = self.tensor_files.get(name)
        return f.name if f else self.config_file

    def tensor(self, name: str) -> torch.Tensor:
        file = self.tensor_files.get(name)
        if file is None:
            raise CompressedTensorsError(f"{self.path}: no tensor {name!r} in the weight files")
        with safe_open(str(file), "pt") as f:
            return f.get_tensor(name)

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for file in self.weight_files:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        return out

    def quantized_modules(self) -> list[str]:
        """Prefixes of the modules that carry quantized weights (a weight scale)."""
        return [n.rpartition(".")[0] for n in self.infos if n.endswith(".weight_scale")]

    def group_for(self, prefix: str) -> Group | None:
        """The config group of a quantized module: exact names first, then regexes, then classes
        (compressed-tensors' precedence)."""
        for kind in ("exact", "regex", "class"):
            for g in self.groups:
                ts = [t for t in g.targets if (kind == "exact" and not t.startswith("re:"))
                      or (kind == "regex" and t.startswith("re:"))]
                if kind == "class":
                    if _class_target(g.targets):
                        return g
                elif match(prefix, ts):
                    return g
        return None

    def is_ignored(self, prefix: str) -> bool:
        return match(prefix, self.ignore)


def is_compressed_tensors(path: Path) -> bool:
    """Whether `path/config.json` says compressed-tensors (or the older `compression_config`)."""
    cfg = _read_config(path, required=False)
    if not cfg:
        return False
    q = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() in (QUANT_METHOD, "sparseml")


def _read_config(path: Path, required: bool = True) -> dict | None:
    f = path / "config.json"
    if not f.is_file():
        if required:
            raise CompressedTensorsError(f"{path}: no config.json")
        return None
    return load_json_object(f, CompressedTensorsError)


def weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        return shard_index_files(index, CompressedTensorsError)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CompressedTensorsError(f"{path}: no *.safetensors weight files")
    return files


def read_compressed_tensors(path: str | os.PathLike) -> CTCheckpoint:
    path = Path(path)
    config = _read_config(path)
    q = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(q, dict):
        raise CompressedTensorsError(f"{path / 'config.json'}: no quantization_config")
    global_format = str(q.get("format") or "dense")
    groups = []
    for name, g in (q.get("config_groups") or {}).items():
        if isinstance(g, list):
            g = _preset(name, g)
        if not isinstance(g, dict) or "targets" not in g:
            raise CompressedTensorsError(f"{path / 'config.json'}: config group {name!r} has no targets")
        groups.append(Group(name, list(g["targets"]), QArgs.from_dict(g.get("weights")),
                            QArgs.from_dict(g.get("input_activations")), QArgs.from_dict(g.get("output_activations")),
                            str(g.get("format") or global_format)))
    files = weight_files(path)
    infos: dict[str, TensorInfo] = {}
    tensor_files: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    infos[key] = TensorInfo(_ST_DTYPES.get(sl.get_dtype(), torch.uint8), tuple(sl.get_shape()))
                    tensor_files[key] = file
        except (SafetensorError, OSError) as e:
            raise CompressedTensorsError(f"{file}: corrupt or truncated safetensors file ({e})") from None
    return CTCheckpoint(path, config, q, groups, list(q.get("ignore") or []),
                        QArgs.from_dict(q.get("kv_cache_scheme")), global_format, files, tensor_files, infos)


# ------------------------------------------------------------------------ packing

def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed `bits`-bit integers [n, k] -> int32 [n, ceil(k / (32 // bits))]: shifted to
    unsigned by 2^(bits-1), packed along k, element i of a word in bits [bits*i, bits*i + bits)."""
    per_word = 32 // bits
    n, k = values.shape
    u = values.to(torch.int64) + (1 << (bits - 1))
    pad = (-k) % per_word
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(n, -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (u << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 [n, words] -> int8 [n, k]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    u = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = u.reshape(packed.shape[0], -1)[:, :k] - (1 << (bits - 1))
    return values.to(torch.int8)


def int_weight(ct: CTCheckpoint, prefix: str, tensors: Mapping[str, torch.Tensor], bits: int) -> torch.Tensor:
    """The integer weight values int8 [n, k] of a quantized Linear, packed or not."""
    if f"{prefix}.weight_packed" in tensors:
        shape = tensors.get(f"{prefix}.weight_shape")
        if shape is None:
            raise CompressedTensorsError(f"{ct.file_of(prefix + '.weight_packed')}: {prefix}.weight_packed has "
                                         "no weight_shape")
        n, k = (int(v) for v in shape.reshape(-1).tolist())
        packed = tensors[f"{prefix}.weight_packed"]
        if packed.dtype != torch.int32 or packed.shape[0] != n or packed.shape[1] != math.ceil(k / (32 // bits)):
            raise CompressedTensorsError(f"{ct.file_of(prefix + '.weight_packed')}: {prefix}.weight_packed is "
                                         f"{packed.dtype} {list(packed.shape)}, expected int32 packed "
                                         f"{bits}-bit values of shape [{n}, {k}]")
        return unpack_int32(packed, bits, k)
    w = tensors.get(f"{prefix}.weight")
    if w is None:
        raise CompressedTensorsError(f"{ct.config_file}: quantized layer {prefix} has neither weight nor "
                                     "weight_packed")
    if w.dtype != torch.int8:
        raise CompressedTensorsError(f"{ct.file_of(prefix + '.weight')}: {prefix}.weight is {w.dtype}, not int8 "
                                     "(float or dense weights are not a quantized checkpoint)")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if w.numel() and (int(w.min()) < lo or int(w.max()) > hi):
        raise CompressedTensorsError(f"{ct.file_of(prefix + '.weight')}: {prefix}.weight has values outside "
                                     f"the {bits}-bit range [{lo}, {hi}]")
    return w


# ------------------------------------------------------------------------ writing

def build_quantization_config(groups: list[Group], ignore: list[str], kv_cache_scheme: QArgs | None) -> dict:
    formats = {g.format for g in groups}
    fmt = formats.pop() if len(formats) == 1 else (MIXED if formats else "dense")
    cfg_groups = {}
    for g in groups:
        d = {"targets": g.targets,
             "weights": g.weights.to_dict() if g.weights else None,
             "input_activations": g.input_activations.to_dict() if g.input_activations else None,
             "output_activations": None,
             "format": g.format}
        cfg_groups[g.name] = d
    return {"quant_method": QUANT_METHOD, "format": fmt, "quantization_status": "compressed",
            "config_groups": cfg_groups, "ignore": list(ignore),
            "kv_cache_scheme": kv_cache_scheme.to_dict() if kv_cache_scheme else None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}


def write_compressed_tensors(out: str | os.PathLike, tensors: Mapping[str, torch.Tensor], config: dict, *,
                             source_dir: str | os.PathLike | None = None,
                             max_shard_size: int | str = "5GB") -> Path:
    """Write a compressed-tensors folder atomically (temp sibling renamed at the end);
    `config` is the whole config.json (with its quantization_config)."""
    return write_weights_folder(out, tensors, filename_pattern="model{suffix}.safetensors",
                                source_dir=source_dir, config=config, max_shard_size=max_shard_size,
                                file_metadata={"format": "pt"})
