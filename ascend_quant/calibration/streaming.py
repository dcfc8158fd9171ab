"""Layer streaming: build the model without its weights and read each decoder layer's
tensors from the safetensors files only when the calibrator reaches that layer.

The calibrator needs one float layer at a time (the quantized ones keep only their int8
copy), so streaming keeps the resident float weights at the embeddings plus one layer,
instead of the whole model, and a model larger than RAM calibrates as long as one layer and
its activations fit. Tensors are read as private copies through short-lived file handles,
so no memory map of the checkpoint stays resident (the writer alone reads views of the map,
each dropped once written). The input embedding is read only at the rows of the calibration
tokens, and the head not at all: the writer copies both from the files.

MoE layers are swapped for per-expert Linears (arch/moe.py) before the names are matched:
their tensors are the per-expert ones on disk (`experts.E.gate_proj.weight`, under the
disk's block name), or one expert's slice of a fused-on-disk `experts.gate_up_proj`
[E, 2I, H] (gate rows first) or `experts.down_proj` [E, H, I], read alone (also stored
transposed, [E, H, 2I] / [E, I, H], as some exports do).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from ascend_quant.calibration import CalibrationError


class StreamingUnavailable(Exception):
    """The folder cannot be streamed (no safetensors, names that differ from the modules)."""


def _unreadable(path: Path, e: Exception):
    """A weights file that cannot be read (truncated, corrupt): one line naming it."""
    detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return CalibrationError(f"{path}: cannot read the weights ({detail})")


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from None


class WeightFiles:
    """Which safetensors file holds each tensor of a checkpoint folder."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {name: folder / file for name, file in weight_map.items()}
        else:
            self.where = {}
            for path in sorted(folder.glob("*.safetensors")):
                with _open(path) as f:
                    self.where.update({name: path for name in f.keys()})
        if not self.where:
            raise StreamingUnavailable(f"{folder}: no safetensors weights")

    def _by_file(self, names: list[str]) -> dict[Path, list[str]]:
        """`names` grouped by the file that holds them (each file is opened once)."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.where[name]].append(name)
        return by_file

    def read(self, names: list[str], dtype: torch.dtype, device: str = "cpu",
             mapped: bool = False) -> dict[str, torch.Tensor]:
        """The tensors as private copies, or (`mapped`, for a reader that drops them at once,
        the writer) those already in `dtype` on the CPU as views of the file's memory map:
        file pages, no anonymous copy."""
        from safetensors import SafetensorError

        out = {}
        for path, file_names in self._by_file(names).items():
            with _open(path) as f:
                for name in file_names:
                    try:
                        t = f.get_tensor(name)
                    except (SafetensorError, OSError) as e:
                        raise _unreadable(path, e) from None
                    # a copy of our own, unless asked for the map (which the tensor keeps open)
                    keep = mapped and t.dtype == dtype and device == "cpu"
                    out[name] = t if keep else t.to(device=device, dtype=dtype, copy=True)
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        with _open(self.where[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def headers(self, names: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
        """The stored shape and safetensors dtype (`"BF16"`, `"F8_E4M3"`) of `names`, one open per file."""
        out = {}
        for path, file_names in self._by_file(names).items():
            with _open(path) as f:
                for n in file_names:
                    part = f.get_slice(n)
                    out[n] = tuple(part.get_shape()), part.get_dtype()
        return out

    def read_rows(self, name: str, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`name[rows]` (rows: 1-D int64) as a private copy: only those rows' pages of the file
        are read."""
        from safetensors import SafetensorError

        path = self.where[name]
        with _open(path) as f:
            try:
                t = f.get_tensor(name)       # backed by the file's memory map, not yet read
            except (SafetensorError, OSError) as e:
                raise _unreadable(path, e) from None
            return t[rows].to(dtype)

    def read_index(self, name: str, index: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        """`name[index]` alone (one expert of a fused tensor), as a private copy."""
        from safetensors import SafetensorError

        path = self.where[name]
        with _open(path) as f:
            try:
                t = f.get_slice(name)[index]
            except (SafetensorError, OSError) as e:
                raise _unreadable(path, e) from None
            return t.to(device=device, dtype=dtype, copy=True)


class StreamedModel:
    """A transformers causal LM whose decoder layers are loaded on demand."""

    def __init__(self, folder: Path, device: str = "cpu"):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from ascend_quant.arch import explicit_spec, replace_experts, spec_for_model
        from ascend_quant.arch.discovery import find_layers

        self.folder, self.device = Path(folder), device
        self.rotation = None                  # a RotationPlan once `rotate` is called
        self.files = WeightFiles(self.folder)
        config = AutoConfig.from_pretrained(self.folder)
        with init_empty_weights(include_buffers=False):      # parameters on meta, buffers real
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.eval()
        self.model = model
        explicit = explicit_spec(config) is not None
        # without an explicit spec the layers are found by structure now, the rest is probed
        # below on the embeddings and layer 0 (discovery needs their weights)
        self.spec = spec_for_model(model) if explicit else None
        if explicit:
            replace_experts(model, self.spec)       # MoE: per-expert Linears, still on meta
        layers_path = self.spec.layers_path if explicit else find_layers(model)
        names = list(model.state_dict())
        shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        out_emb = model.get_output_embeddings()
        tied_name = next((n for n, p in model.named_parameters(remove_duplicate=False)
                          if out_emb is not None and p is out_emb.weight and n.startswith("lm_head")), None)
        needed = [n for n in names if not (self.tied and n == tied_name)]
        # model name -> (disk name, None) or, for one expert's slice of a fused tensor,
        # (disk name, (expert, row chunk of 2 or None, transposed))
        self.sources: dict[str, tuple[str, tuple | None]] = {}
        for n in needed:
            source = self._source(n, shapes[n])
            if source is not None:
                self.sources[n] = source
        missing = [n for n in needed if n not in self.sources]
        if missing:
            raise StreamingUnavailable(f"{len(missing)} tensors not found by name, e.g. {missing[0]}")
        layers = layers_path + "."
        self.outer_names = [n for n in needed if not n.startswith(layers)]
        emb = model.get_input_embeddings()
        # the input embedding matrix (vocabulary x hidden) is read row by row for the tokens the
        # calibration samples hold (`load_embedding_rows`); discovery probes random tokens, so
        # then it is read whole
        self.embedding_name = next((n for n, p in model.named_parameters() if emb is not None and p is emb.weight
                                    and n in self.outer_names), None) if explicit else None
        self.layer_names: dict[int, list[str]] = defaultdict(list)
        for n in needed:
            if n.startswith(layers):
                self.layer_names[int(n[len(layers):].split(".", 1)[0])].append(n)
        # the head is not needed until the checkpoint is written (the writer reads it from the files)
        head = tied_name or next((n for n, p in model.named_parameters() if out_emb is not None
                                  and p is out_emb.weight), None)
        self.head_name = head
        self._load([n for n in self.outer_names if n not in (self.embedding_name, head)])
        self._tie()
        if not explicit:
            self.load_layer(0)
            try:
                spec_for_model(model)             # discovered once, kept with the model
            finally:
                self.release(self.layer_names[0])
        self.spec = spec_for_model(model)

    def _source(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple | None] | None:
        """Where tensor `name` (a model state-dict name of `shape`) is read from, or None."""
        disk = self.spec.to_disk(name) if self.spec is not None else name
        if disk in self.files.where:
            return disk, None
        moe = self.spec.moe if self.spec is not None else None
        rel = self.spec.relative(name)
        if moe is None or rel is None or moe.expert_of(rel) is None or not rel.endswith(".weight"):
            return None
        e = moe.expert_of(rel)
        role = moe.linears.index(rel[:-len(".weight")].rpartition(".")[2])
        base = self.spec.to_disk(name[: len(name) - len(rel)] + moe.experts_path)
        fused = f"{base}.{'down_proj' if role == 2 else 'gate_up_proj'}"
        fused = next((f for f in (fused, fused + ".weight") if f in self.files.where), None)
        if fused is None:
            return None
        fshape = self.files.shape(fused)[1:]
        rows = shape[0] * (1 if role == 2 else 2)
        if fshape == (rows, shape[1]):
            transposed = False
        elif fshape == (shape[1], rows):
            transposed = True
        else:
            raise CalibrationError(f"{fused}: shape {list(self.files.shape(fused))} does not hold expert {e}'s "
                                   f"{list(shape)} {moe.linears[role]}")
        return fused, (e, None if role == 2 else role, transposed)

    def read(self, names: list[str], dtype: torch.dtype, mapped: bool = False) -> dict[str, torch.Tensor]:
        """Tensors by model state-dict name, from their source (whole, or one expert's slice;
        `mapped`: see WeightFiles.read), rotated where the model is (`rotate`)."""
        plan = self.rotation
        turned = [n for n in names if plan is not None and plan.inputs(n) is not None]
        out = self._read_stored([n for n in names if n not in turned], dtype, mapped)
        if turned:                            # their inputs read once, float32 as in the whole-model rotation
            values = self._read_stored(sorted({m for n in turned for m in plan.inputs(n)}), torch.float32)
            gains = {m for n in turned for m in plan.inputs(n)[1:]}
            for n in turned:
                out[n] = plan.rotated(n, values).to(self.device, dtype)
                if n not in gains:            # its unrotated copy is not read again
                    del values[n]
        return out

    def rotate(self, plan) -> None:
        """From now on every tensor is read rotated by `plan` (calibration/rotation.py's
        RotationPlan, drawn on this model): the layers as the calibrator loads them, the
        embedding rows, and what the writer reads again. A tied head gets a weight of its
        own, read from the embedding's tensor."""
        self.rotation = plan
        if self.tied:
            head = self.model.get_output_embeddings()
            head.weight = torch.nn.Parameter(torch.empty(head.weight.shape, device="meta"), requires_grad=False)
            self.sources[plan.head] = self.sources[plan.embedding]
            self.outer_names.append(plan.head)
            self.head_name, self.tied = plan.head, False
        from ascend_quant.calibration.rotation import untie_config
        untie_config(self.model.config)
        self._load([n for n, p in self.model.named_parameters() if not p.is_meta])    # read again, rotated

    def _read_stored(self, names: list[str], dtype: torch.dtype, mapped: bool = False) -> dict[str, torch.Tensor]:
        """`read` without the rotation: the tensors as the files hold them."""
        direct: dict[str, list[str]] = defaultdict(list)     # disk name -> model names (a rotated
        for n in names:                                      # tied head reads the embedding's)
            if self.sources[n][1] is None:
                direct[self.sources[n][0]].append(n)
        out = {n: t for d, t in self.files.read(list(direct), dtype, self.device, mapped).items() for n in direct[d]}
        for n in names:
            disk, part = self.sources[n]
            if part is None:
                continue
            e, chunk, transposed = part
            t = self.files.read_index(disk, e, dtype, self.device)
            t = t.t() if transposed else t
            if chunk is not None:
                t = t.chunk(2, dim=0)[chunk]
            out[n] = t.contiguous()
        return out

    def _set(self, name: str, tensor: torch.Tensor) -> None:
        """Put `tensor` in the model under its state-dict name (parameter or buffer)."""
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor

    def _load(self, names: list[str]) -> None:
        for name, tensor in self.read(names, torch.float32).items():
            self._set(name, tensor)

    def _tie(self) -> None:
        out_emb = self.model.get_output_embeddings()
        if self.tied and out_emb is not None:
            out_emb.weight = self.model.get_input_embeddings().weight

    def release_outer(self) -> None:
        """Drop the embeddings, final norm and head while the layers are calibrated (the
        calibrator needs them only before the first layer; the writer reads them again)."""
        self.release(self.outer_names)
        self._tie()

    def release(self, names: list[str]) -> None:
        """Drop these parameters (state-dict names), leaving meta tensors of their shape."""
        params = dict(self.model.named_parameters())
        for name in names:
            if name in params and not params[name].is_meta:
                self._set(name, torch.empty(params[name].shape, device="meta"))

    def load_outer(self) -> None:
        """Read the embeddings and head whole (what a full forward needs; calibration does not)."""
        self._load([n for n in self.outer_names if n in (self.embedding_name, self.head_name)])
        self._tie()

    def load_embedding_rows(self, ids: torch.Tensor) -> None:
        """Give the input embedding the rows of the token ids in `ids`, read from the file's
        memory map, in an otherwise unwritten (so not resident) float32 matrix of its full
        shape: the embedding lookup of those tokens is exact, and a model's vocabulary-sized
        matrix does not become anonymous memory. Its other rows are undefined: for the
        forward up to the first layer only, released right after (`release_outer`)."""
        if self.embedding_name is None:
            return
        name = self.embedding_name
        disk = self.sources[name][0]
        shape = dict(self.model.named_parameters())[name].shape
        rows = torch.unique(ids.reshape(-1).cpu())
        weight = torch.empty(shape, dtype=torch.float32, device=self.device)
        values = self.files.read_rows(disk, rows, torch.float32)
        if self.rotation is not None:         # the rule is row by row: these rows alone
            values = self.rotation.rotated(name, {name: values})
        weight[rows] = values.to(self.device)
        self._set(name, weight)
        self._tie()

    def load_layer(self, index: int) -> None:
        """Read decoder layer `index`'s tensors (called just before the calibrator runs it)."""
        self._load(self.layer_names[index])
