"""Read and write the msModelSlim / vllm-ascend checkpoint layout.

The reader accepts every layout msModelSlim has written (v1 `quant_model_weights*.safetensors`
with or without a shard index, v0 `quant_model_weight_<type>.safetensors`, the MindIE-style
`quant_model_description_<type>.json`) and presents one in-memory model:
module prefix -> scheme -> tensor suffixes. The writer emits the v1 layout only, atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from ascend_quant.schemes import C8, FLOAT, SCHEMES, is_float, is_kv, is_linear

DESCRIPTION_NAME = "quant_model_description.json"
WEIGHTS_NAME = "quant_model_weights.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
FORMAT_VERSION = "1.0.0"
# Description keys that are not tensor names.
TOP_LEVEL_KEYS = ("version", "model_quant_type", "group_size", "kv_cache_type", "kv_quant_type",
                  "metadata", "optional")
# Files copied from the source model next to the quantized weights.
MODEL_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                    "LICENSE", "LICENSE.txt")


class CheckpointError(Exception):
    """A folder that is not a readable Ascend checkpoint; the message names file and key."""


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
              "I64": torch.int64, "BOOL": torch.bool}


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Module:
    """All tensors under one module prefix, grouped by the quant type the description gives them.

    `schemes["W8A8"] == {"weight", "deq_scale", ...}`; a quantized k_proj with C8 also has
    `schemes["C8"] == {"kv_cache_scale", "kv_cache_offset"}` and its float bias under FLOAT.
    """
    prefix: str
    schemes: dict[str, set[str]] = field(default_factory=dict)

    @property
    def weight_scheme(self) -> str | None:
        """The type of `<prefix>.weight`, i.e. how the Linear (or norm, embedding) is stored."""
        for scheme, suffixes in self.schemes.items():
            if "weight" in suffixes:
                return scheme
        return None

    @property
    def suffixes(self) -> set[str]:
        return set().union(*self.schemes.values()) if self.schemes else set()

    def scheme_of(self, suffix: str) -> str | None:
        for scheme, suffixes in self.schemes.items():
            if suffix in suffixes:
                return scheme
        return None


@dataclass
class Checkpoint:
    """An Ascend checkpoint folder, read lazily: headers now, tensor data on demand."""
    path: Path
    layout: str                          # "v1", "v1-sharded", "v0", "mindie"
    description_file: Path
    description: dict[str, str]          # tensor name -> quant type
    meta: dict                           # the top-level keys (version, model_quant_type, ...)
    weight_files: list[Path]
    tensor_files: dict[str, Path]        # tensor name -> file that holds it
    infos: dict[str, TensorInfo]
    config: dict | None
    index_file: Path | None = None       # the shard index, if the folder has one
    weight_map: dict[str, str] = field(default_factory=dict)   # its tensor name -> shard file name

    # ------------------------------------------------------------------ access
    def tensor(self, name: str) -> torch.Tensor:
        try:
            file = self.tensor_files[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the weight files") from None
        with safe_open(str(file), "pt") as f:
            return f.get_tensor(name)

    def tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Load tensors (all by default), one open per file."""
        wanted = set(self.tensor_files if names is None else names)
        out: dict[str, torch.Tensor] = {}
        for file in self.weight_files:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    if key in wanted:
                        out[key] = f.get_tensor(key)
        missing = wanted - set(out)
        if missing:
            raise CheckpointError(f"{self.path}: tensors missing from the weight files: {sorted(missing)[:5]}")
        return {k: out[k] for k in (names or self.tensor_files)}

    def modules(self) -> dict[str, Module]:
        """module prefix -> Module, in description order."""
        mods: dict[str, Module] = {}
        for name, qtype in self.description.items():
            prefix, _, suffix = name.rpartition(".")
            mods.setdefault(prefix, Module(prefix)).schemes.setdefault(qtype, set()).add(suffix)
        return mods

    @property
    def group_size(self) -> int:
        return int(self.meta.get("group_size", 0) or 0)

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The serving dtype named by config.json (`dtype` or `torch_dtype`), if any."""
        if not self.config:
            return None
        name = self.config.get("dtype") or self.config.get("torch_dtype")
        return {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}.get(str(name))

    @property
    def kv_cache_int8(self) -> bool:
        return self.meta.get("kv_cache_type") == C8.name or any(is_kv(t) for t in self.description.values())


# ------------------------------------------------------------------------ reading

def find_description(path: Path) -> tuple[Path, str]:
    """The description file of a folder and the layout its name implies."""
    v1 = path / DESCRIPTION_NAME
    if v1.is_file():
        return v1, "v1"
    mindie = sorted(path.glob("quant_model_description_*.json"))
    if len(mindie) == 1:
        return mindie[0], "mindie"
    if len(mindie) > 1:
        raise CheckpointError(f"{path}: several description files ({', '.join(p.name for p in mindie)}); "
                              "keep one")
    raise CheckpointError(f"{path}: no {DESCRIPTION_NAME} (or quant_model_description_<type>.json): "
                          "not an Ascend quantized checkpoint")


def load_json_object(file: Path, error: type[Exception] = CheckpointError) -> dict:
    """A JSON file that must hold an object. Whatever else it holds (a list, a number, bytes
    that are not JSON or not UTF-8, nothing) is one `error` line naming the file, so no reader
    of ours trips over a `.get` or `[...]` on the wrong type later."""
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise error(f"{file}: not valid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(value, dict):
        raise error(f"{file}: expected a JSON object, found {_json_kind(value)}")
    return value


def _json_kind(value: object) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def read_shard_index(index: Path, error: type[Exception] = CheckpointError) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file name) of a `*.safetensors.index.json`.

    Shard names must be plain `*.safetensors` names in the index's folder: the loaders open
    them, so a path that leaves the folder or names another kind of file is refused here."""
    weight_map = load_json_object(index, error).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise error(f"{index}: no 'weight_map' object (tensor name -> shard file)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise error(f"{index}: weight_map sends {name!r} to {shard!r}, not a *.safetensors file name "
                        "in this folder")
    return weight_map


def shard_index_files(index: Path, error: type[Exception] = CheckpointError) -> list[Path]:
    """The shard files a `*.safetensors.index.json` names (each must exist)."""
    files = sorted({index.parent / f for f in read_shard_index(index, error).values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise error(f"{index}: names shard(s) that do not exist: {', '.join(missing)}")
    return files


def find_index(path: Path) -> Path | None:
    """The shard index of a folder (v1 name first, then v0's), if it has one."""
    for index in [path / INDEX_NAME, *sorted(path.glob("quant_model_weight_*.safetensors.index.json"))]:
        if index.is_file():
            return index
    return None


def find_weight_files(path: Path) -> tuple[list[Path], str | None]:
    """The safetensors files that hold the checkpoint's tensors, and 'sharded'/'v0' hints."""
    index = find_index(path)
    if index is not None:
        return shard_index_files(index), "sharded"
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME], None
    v0 = sorted(path.glob("quant_model_weight_*.safetensors"))
    if v0:
        return v0, "v0"
    v1_shards = sorted(path.glob("quant_model_weights-*.safetensors"))
    if v1_shards:
        return v1_shards, "sharded"
    raise CheckpointError(f"{path}: no quant_model_weights*.safetensors or quant_model_weight_*.safetensors")


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype/shape from a safetensors header; corrupt files raise CheckpointError.

    safe_open checks what can be checked without the data: header length and JSON, dtypes,
    and that the offsets tile the data section exactly as the shapes say."""
    try:
        with safe_open(str(file), "pt") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = TensorInfo(_ST_DTYPES.get(sl.get_dtype(), torch.uint8), tuple(sl.get_shape()))
            return out
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({' '.join(str(e).split())})") from None


# Top-level description keys: the JSON types a reader may rely on (None: key may be null).
_META_TYPES = {"model_quant_type": (str,), "group_size": (int,), "kv_cache_type": (str, type(None)),
               "kv_quant_type": (str, type(None)), "metadata": (dict,), "optional": (dict,)}
# config.json keys the checks read for the geometry: positive integers (or null) when present.
_CONFIG_SIZES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")


def _check_meta(desc_file: Path, meta: dict) -> None:
    """Refuse top-level description values of the wrong JSON type (a string group_size, a list
    for metadata) here, once, instead of wherever they are used."""
    for key, types in _META_TYPES.items():
        value = meta.get(key)
        if key in meta and (not isinstance(value, types) or isinstance(value, bool)):
            raise CheckpointError(f"{desc_file}: top-level {key!r} is {value!r}; expected "
                                  f"{' or '.join('null' if t is type(None) else t.__name__ for t in types)}")
    if meta.get("group_size", 0) < 0:
        raise CheckpointError(f"{desc_file}: top-level 'group_size' is {meta['group_size']}; expected 0 "
                              "(per-channel) or a positive group size")


def _check_config(file: Path, config: dict) -> None:
    """The geometry keys verify and inspect compute with must be positive integers, and a saved
    architecture spec readable."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CheckpointError(f"{file}: 'text_config' is {_json_kind(text)}; expected an object")
    for cfg in (config, text or {}):
        for key in _CONFIG_SIZES:
            value = cfg.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise CheckpointError(f"{file}: {key!r} is {value!r}; expected a positive integer")
    from ascend_quant.arch import UnsupportedModelError, spec_for_config
    try:                    # a discovered architecture spec saved by calibration must read back
        spec_for_config(config)
    except UnsupportedModelError as e:
        raise CheckpointError(f"{file}: {e}") from None


def text_config(config: dict | None) -> dict:
    """The part of a config.json that describes the language model: `text_config` where a
    multimodal config nests it, else the config itself ({} for none)."""
    nested = (config or {}).get("text_config")
    return nested if isinstance(nested, dict) else (config or {})


def kv_geometry(config: dict | None) -> tuple[int, int] | None:
    """(num_key_value_heads, head_dim) of a config.json (its text_config if it has one), or None
    where it does not say; head_dim falls back to hidden_size // num_attention_heads."""
    cfg = text_config(config)
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    head_dim, hidden = cfg.get("head_dim"), cfg.get("hidden_size")
    kv_heads = kv_heads or heads
    if not head_dim and hidden and heads:
        head_dim = hidden // heads
    ints = isinstance(kv_heads, int) and isinstance(head_dim, int)
    return (kv_heads, head_dim) if ints and kv_heads > 0 and head_dim > 0 else None


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read an Ascend checkpoint folder's description, config and tensor headers."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such folder")
    desc_file, layout = find_description(path)
    raw = load_json_object(desc_file)
    meta = {k: raw[k] for k in raw if k in TOP_LEVEL_KEYS}
    _check_meta(desc_file, meta)
    description = {}
    for k, v in raw.items():
        if k in TOP_LEVEL_KEYS:
            continue
        if not isinstance(v, str):
            raise CheckpointError(f"{desc_file}: key {k!r} has non-string value {v!r}")
        description[k] = v
    files, hint = find_weight_files(path)
    if layout == "v1":
        layout = {"sharded": "v1-sharded", "v0": "v0"}.get(hint or "", "v1")
    infos: dict[str, TensorInfo] = {}
    tensor_files: dict[str, Path] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in tensor_files:
                raise CheckpointError(f"{file}: tensor {name!r} is also in {tensor_files[name].name}; "
                                      "a loader would keep either one")
            infos[name] = info
            tensor_files[name] = file
    config = None
    if (path / "config.json").is_file():
        config = load_json_object(path / "config.json")
        _check_config(path / "config.json", config)
    index = find_index(path)
    weight_map = read_shard_index(index) if index is not None else {}
    return Checkpoint(path, layout, desc_file, description, meta, files, tensor_files, infos, config,
                      index, weight_map)


# ------------------------------------------------------------------------ writing

def dominant_quant_type(description: Mapping[str, str]) -> str:
    """The most common quant type among `.weight` keys that are quantized (FLOAT if none)."""
    counts = Counter(t for name, t in description.items()
                     if name.endswith(".weight") and is_linear(t))
    return counts.most_common(1)[0][0] if counts else FLOAT.name


def build_description(description: Mapping[str, str], group_size: int = 0,
                      metadata: dict | None = None) -> dict:
    """The v1 description JSON: top-level keys first, then every tensor name."""
    for name, qtype in description.items():
        if qtype not in SCHEMES:
            raise ValueError(f"{name}: unknown quant type {qtype!r}")
    out: dict = {"version": FORMAT_VERSION,
                 "model_quant_type": dominant_quant_type(description),
                 "group_size": int(group_size)}
    if any(is_kv(t) for t in description.values()):
        out["kv_cache_type"] = C8.name
        out["kv_quant_type"] = C8.name   # msModelSlim writes both spellings
    out["metadata"] = dict(metadata or {})
    out["optional"] = {}
    out.update(description)
    return out


def with_ascend_quantization_config(config: dict | None, desc: Mapping) -> dict | None:
    """config.json whose `quantization_config` says `ascend` carries the whole description.

    vLLM hands `quantization_config` to the method's `from_config`, and vllm-ascend (0.23) takes
    that dict as the complete description: it then never reads quant_model_description.json,
    and a short `{"quant_method": "ascend"}` makes every Linear fail with a KeyError (found by
    `tests/test_vllm_ascend_layout.py` running vllm-ascend's own config on our folders). With
    the description inside, both vllm-ascend and our plugin pick the method from config.json
    alone; msModelSlim's own folders have no quantization_config and need `--quantization`."""
    if config is None or not isinstance(config.get("quantization_config"), dict) or \
            config["quantization_config"].get("quant_method") != "ascend":
        return config
    return {**config, "quantization_config": {"quant_method": "ascend", **desc}}


def write_checkpoint(out: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                     description: Mapping[str, str], *, group_size: int = 0,
                     source_dir: str | os.PathLike | None = None, config: dict | None = None,
                     metadata: dict | None = None, max_shard_size: int | str = "5GB",
                     extra_files: Mapping[str, str | bytes] | None = None,
                     overwrite: bool = False, loader: Callable[[str], torch.Tensor] | None = None) -> Path:
    """Write a v1 checkpoint folder atomically.

    Everything is written into a temporary sibling folder that is renamed to `out` only
    when complete, so an interrupted run leaves no folder that looks whole. `source_dir`
    contributes config and tokenizer files (never weights); `config` replaces config.json.
    `extra_files` are written verbatim (e.g. the recipe, the model card). Meta tensors are
    placeholders: `loader(name)` gives their values when their turn to be written comes.
    """
    out = Path(out)
    missing = set(tensors) - set(description)
    extra = set(description) - set(tensors)
    if missing or extra:
        raise ValueError(f"description and tensors disagree: no type for {sorted(missing)[:3]}, "
                         f"no tensor for {sorted(extra)[:3]}")
    desc = build_description(description, group_size, metadata)
    files = {DESCRIPTION_NAME: json.dumps(desc, indent=2) + "\n", **(extra_files or {})}
    config = with_ascend_quantization_config(config, desc)
    return write_weights_folder(out, tensors, filename_pattern="quant_model_weights{suffix}.safetensors",
                                source_dir=source_dir, config=config, extra_files=files,
                                max_shard_size=max_shard_size, overwrite=overwrite, loader=loader)


def write_weights_folder(out: str | os.PathLike, tensors: Mapping[str, torch.Tensor], *, filename_pattern: str,
                         source_dir: str | os.PathLike | None = None, config: dict | None = None,
                         extra_files: Mapping[str, str | bytes] | None = None, max_shard_size: int | str = "5GB",
                         overwrite: bool = False, file_metadata: dict[str, str] | None = None,
                         loader: Callable[[str], torch.Tensor] | None = None) -> Path:
    """Write a model folder atomically: config/tokenizer files from `source_dir` (never weights),
    `config` as config.json, the tensors as safetensors shards named by `filename_pattern`
    (with an index when sharded), and `extra_files` verbatim; all into a temporary sibling
    that is renamed to `out` only when complete. Both checkpoint layouts are written by it."""
    from huggingface_hub import split_torch_state_dict_into_shards

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if source_dir is not None:
            for name in MODEL_SIDE_FILES:
                src = Path(source_dir) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = _unshared({k: v if v.is_meta else v.detach().contiguous().cpu() for k, v in tensors.items()})
        split = split_torch_state_dict_into_shards(state, filename_pattern=filename_pattern,
                                                   max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            save_file({k: state[k] for k in names}, str(tmp / filename), metadata=file_metadata, loader=loader)
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            index_name = filename_pattern.format(suffix="") + ".index.json"
            (tmp / index_name).write_text(json.dumps(index, indent=2) + "\n")
        for name, content in (extra_files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode) as f:
                f.write(content)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


_DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                torch.uint8: "U8", torch.bool: "BOOL"}


def save_file(tensors: Mapping[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None,
              loader: Callable[[str], torch.Tensor] | None = None) -> None:
    """Write a safetensors file tensor by tensor (the format: 8-byte little-endian header
    length, a JSON header of dtype/shape/offsets, then the raw data). Unlike
    safetensors.torch.save_file it never holds a serialized copy of the whole file in
    memory, which sets the calibrator's peak memory otherwise. Largest itemsize first, so
    every tensor starts aligned. A meta tensor is read through `loader(name)` just before
    it is written (and must come back with the placeholder's dtype and shape)."""
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(filename, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            t = tensors[name]
            if t.is_meta:
                if loader is None:
                    raise ValueError(f"{name}: a placeholder (meta) tensor and no loader to read it")
                value = loader(name)
                if value.dtype != t.dtype or value.shape != t.shape:
                    raise ValueError(f"{name}: read {value.dtype} {tuple(value.shape)}, "
                                     f"expected {t.dtype} {tuple(t.shape)}")
                t = value
            t = t.detach().contiguous().cpu()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory: copy all but the first of each."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() and not v.is_meta else (id(v), 0)
        out[k] = v.clone() if key in seen else v
        seen.add(key)
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished temp folder to `out`, replacing an existing one last."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def copy_checkpoint(ckpt: Checkpoint, out: str | os.PathLike, **kwargs) -> Path:
    """Re-write a checkpoint read from any layout in the v1 layout (config, tokenizer kept)."""
    return write_checkpoint(out, ckpt.tensors(), ckpt.description, group_size=ckpt.group_size,
                            source_dir=ckpt.path, metadata=ckpt.meta.get("metadata"), **kwargs)


def iter_linear_weights(ckpt: Checkpoint) -> Iterator[tuple[str, str]]:
    """(module prefix, scheme) of every quantized Linear (a `.weight` with a non-FLOAT type)."""
    for prefix, mod in ckpt.modules().items():
        scheme = mod.weight_scheme
        if scheme is not None and not is_float(scheme):
            yield prefix, scheme
