"""The calibration job: load or stream the model, tokenize the data, run the runner, write
the checkpoint with its provenance (source identity, config with the quant method, recipe,
calibration record)."""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ascend_quant.arch import SAVED_SPEC_KEY, ArchSpec, spec_for_model
from ascend_quant.arch.spec import config_get
from ascend_quant.calibration import CalibrationError
from ascend_quant.calibration.recipe import Recipe
from ascend_quant.calibration.online_rotation import refusal as online_refusal
from ascend_quant.calibration.rotation import (RotationPlan, refusal as rotation_refusal, rotate_model,
                                               untie_config)
from ascend_quant.calibration.runner import LayerReport, quantize_model
from ascend_quant.schemes import FLOAT, INPUT_ROTATION, SCHEMES, QuantizedLinear, checkpoint_entries, kv_entries


class LayerSpill:
    """The quantized Linears of each finished layer, packed into their checkpoint tensors and
    written to a safetensors file of their own in `folder` (a temporary folder beside the
    output) as soon as the layer is done, so calibration never holds every layer's
    quantized weights at once. `quantize_model` calls it per layer; the writer reads the
    tensors back one at a time (`read`)."""

    def __init__(self, folder: Path, spec: ArchSpec, model_dtype: torch.dtype):
        self.folder, self.spec, self.model_dtype = Path(folder), spec, model_dtype
        self.schemes: dict[str, str] = {}                        # module name -> scheme, in calibration order
        self.entries: dict[str, tuple[torch.Tensor, str]] = {}   # tensor name -> (meta placeholder, type)
        self.where: dict[str, Path] = {}                         # tensor name -> its file
        self.files = 0

    def __call__(self, layer_results: dict[str, QuantizedLinear]) -> None:
        from ascend_quant.formats.ascend import save_file

        tensors: dict[str, torch.Tensor] = {}
        for prefix, qlin in layer_results.items():
            self.schemes[prefix] = qlin.scheme
            for name, (t, kind) in checkpoint_entries(qlin, self.spec.to_disk(prefix), self.model_dtype).items():
                tensors[name] = t
                self.entries[name] = (torch.empty(t.shape, dtype=t.dtype, device="meta"), kind)
        if not tensors:
            return
        file = self.folder / f"layer-{self.files:05d}.safetensors"
        save_file(tensors, str(file))
        self.files += 1
        self.where.update(dict.fromkeys(tensors, file))

    def read(self, name: str) -> torch.Tensor:
        """A spilled tensor, as a copy of its own (no mapping of the file stays open)."""
        from safetensors import safe_open

        with safe_open(str(self.where[name]), "pt") as f:
            return f.get_tensor(name).clone()


def checkpoint_tensors(model, results: dict[str, QuantizedLinear],
                       kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]], model_dtype: torch.dtype,
                       spilled: LayerSpill | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the output checkpoint and its description type. Float tensors still
    on the meta device (released by a streamed calibration, unchanged from the source) come
    out as meta tensors of the output dtype, and so do the `spilled` layers' tensors: the
    writer's `loader` reads them."""
    spec = spec_for_model(model)
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for name, (t, kind) in (spilled.entries if spilled is not None else {}).items():
        tensors[name], types[name] = t, kind
    for prefix, qlin in results.items():
        for name, (t, kind) in checkpoint_entries(qlin, spec.to_disk(prefix), model_dtype).items():
            tensors[name], types[name] = t, kind
    quantized = set(results) | set(spilled.schemes if spilled is not None else ())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, param in model.state_dict().items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == INPUT_ROTATION:     # an online rotation's signs, whatever the Linear's scheme
            tensors[spec.to_disk(name)], types[spec.to_disk(name)] = param.detach().float(), FLOAT.name
            continue
        if prefix in quantized or (tied and name == "lm_head.weight"):
            continue
        dtype = float_dtype_of(model, name, model_dtype)
        disk = spec.to_disk(name)        # the router and persistent buffers too (e_score_correction_bias)
        tensors[disk] = torch.empty(param.shape, dtype=dtype, device="meta") if param.is_meta else param.detach().to(dtype)
        types[disk] = FLOAT.name
    for layer_prefix, (k_scale, v_scale) in kv_scales.items():      # C8 scales sit on the K/V projections
        for proj, scale in zip(spec.kv_projections, (k_scale, v_scale)):
            for name, (t, kind) in kv_entries(f"{layer_prefix}.{proj}", scale).items():
                tensors[name], types[name] = t, kind
    return tensors, types


def _float_dtype(model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if model_dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def float_dtype_of(model, name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a FLOAT tensor is written in: the model's, but float32 for the tensors
    transformers keeps in float32 whatever the model's dtype (`_keep_in_fp32_modules_strict`:
    DeepSeek-V3's e_score_correction_bias, which vLLM loads into a float32 parameter)."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    return torch.float32 if any(m in name for m in keep) else _float_dtype(model_dtype)


def extra_layer_tensors(model, files, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Placeholders (meta tensors) for the source's tensors of decoder layers stored after the
    model's own (DeepSeek-V3's MTP layers, `ArchSpec.is_extra_layer`): transformers builds no
    module for them, so they are copied as they are, FLOAT (`files`: the source's WeightFiles).
    A quantized one (DeepSeek-V3's own FP8 files) is refused: dequantize the source first."""
    spec = spec_for_model(model)
    names = [n for n in files.where if spec.is_extra_layer(n, model.config)]
    headers = files.headers(names)
    odd = next((n for n, (_, dtype) in headers.items() if dtype not in ("F32", "F16", "BF16")), None)
    if odd is not None:
        raise CalibrationError(f"{odd}: stored as {headers[odd][1]} in a layer after the model's own (MTP), "
                               "copied FLOAT; dequantize the source checkpoint first")
    return {n: torch.empty(shape, dtype=float_dtype_of(model, n, model_dtype), device="meta")
            for n, (shape, _) in headers.items()}


def config_with_quant_method(config: dict, hints: dict[str, str] | None = None) -> dict:
    """config.json for the output: msModelSlim drops quantization_config; we add ours so that
    vLLM picks the `ascend` method without --quantization (the writer puts the description in
    it, which vllm-ascend needs). `hints`: top-level keys such as MoE's `quantize` /
    `moe_quantize` (`moe_hints`)."""
    cfg = json.loads(json.dumps(config))
    cfg.update(hints or {})
    cfg["quantization_config"] = {"quant_method": "ascend"}
    return cfg


def moe_hints(model, schemes: dict[str, str]) -> dict[str, str]:
    """msModelSlim's config.json hints for a MoE model: `moe_quantize`, the routed experts'
    scheme, `quantize`, the other Linears' most common one, and for MLA `mla_quantize`, the
    scheme of its input group, lower-case (`"w8a8_dynamic"`); nothing for a dense model or
    float experts (`schemes`: each quantized Linear's, by module name)."""
    spec = spec_for_model(model)
    if spec.moe is None:
        return {}
    experts, others, mla = [], [], []
    mla_linears = next((g.linears for g in spec.groups if g.name == spec.mla_group), ())
    for prefix, scheme in schemes.items():
        rel = spec.relative(prefix)
        (experts if rel is not None and spec.moe.expert_of(rel) is not None else others).append(scheme)
        if rel in mla_linears:
            mla.append(scheme)
    if not experts:
        return {}
    hints = {"moe_quantize": Counter(experts).most_common(1)[0][0].lower()}
    if others:
        hints["quantize"] = Counter(others).most_common(1)[0][0].lower()
    if mla:
        hints["mla_quantize"] = Counter(mla).most_common(1)[0][0].lower()
    return hints


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@dataclass
class CalibrationResult:
    out: Path
    seconds: float
    num_samples: int
    seq_len: int
    reports: list[LayerReport]
    spec: ArchSpec | None = None                  # the architecture spec used (discovered: notes say how)
    budget: dict | None = None                    # the quality budget's report (calibration/budget.py)


@dataclass
class LoadedModel:
    tokenizer: object
    model: torch.nn.Module
    source_dtype: torch.dtype
    local: Path                                   # the folder holding config and tokenizer
    stream: object = None                         # a StreamedModel (layers read on demand), or None


def load_model(model_id: str, device: str = "cpu", stream: bool = True) -> LoadedModel:
    """A folder or Hub id as an fp32 model. With `stream` (and safetensors whose names match
    the modules) the decoder layers are read one at a time as calibration reaches them
    (calibration/streaming.py); otherwise the whole model is loaded by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ascend_quant.calibration.streaming import StreamedModel, StreamingUnavailable

    path = Path(model_id)
    if not path.exists() and (model_id.startswith((".", "/", "~")) or model_id.count("/") > 1):
        raise CalibrationError(f"{model_id}: no such model folder")
    where = "folder" if path.exists() else "Hugging Face Hub id (offline or not found?)"
    try:
        local = path if path.exists() else Path(_snapshot_dir(model_id))
        config = AutoConfig.from_pretrained(local)
        tokenizer = AutoTokenizer.from_pretrained(local)
        streamed = None
        if stream:
            try:
                streamed = StreamedModel(local, device)
            except StreamingUnavailable:
                streamed = None
        model = streamed.model if streamed else AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    except OSError as e:
        raise CalibrationError(f"{model_id}: cannot load as a {where}: {str(e).splitlines()[0][:200]}") from None
    except ValueError as e:
        raise CalibrationError(f"{model_id}: {str(e).splitlines()[0][:300]}") from None
    except Exception as e:
        if type(e).__module__.startswith("huggingface_hub"):       # offline, unknown repo, gated, ...
            raise CalibrationError(f"{model_id}: cannot load as a {where}: {type(e).__name__}") from None
        raise
    if device != "cpu" and streamed is None:
        model.to(device)
    source_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(source_dtype, str):
        source_dtype = getattr(torch, source_dtype)
    model.eval()
    return LoadedModel(tokenizer, model, source_dtype, local, streamed)


def rotated_model(loaded: LoadedModel, spec: ArchSpec, rotation) -> dict:
    """Fold the recipe's rotation into a loaded model: a streamed one rotates each tensor as it
    is read (StreamedModel.rotate), a whole one at once; the record of what was done."""
    if loaded.stream is None:
        return rotate_model(loaded.model, spec, rotation.kind, rotation.r2, rotation.seed)
    plan = RotationPlan(loaded.model, spec, rotation.kind, rotation.r2, rotation.seed)
    loaded.stream.rotate(plan)
    return plan.record


def _snapshot_dir(model_id: str) -> str:
    from huggingface_hub import snapshot_download
    return snapshot_download(model_id, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "*.safetensors"])


def calibrate(model_id: str, out: str | Path, recipe: Recipe, dataset: str | None = None,
              num_samples: int = 128, seq_len: int = 512, seed: int = 0, device: str = "cpu",
              chat_template: bool = False, packing: bool = True, show_progress: bool = True,
              overwrite: bool = False,
              extra_files: dict[str, str] | None = None, budget=None,
              log=None) -> CalibrationResult:
    """The whole job: load, sample, quantize layer by layer, write the checkpoint atomically
    (the model card is the CLI's: `hub.write_card`). With a `budget` (calibration/budget.py)
    a quarter of the samples is held out and the fewest Linear groups that meet it on them
    are calibrated in the fallback scheme; `log` takes its progress lines."""
    from ascend_quant.calibration.data import Samples, load_texts, tokenize_samples
    from ascend_quant.formats.ascend import write_checkpoint

    say = log or (lambda line: None)
    out = Path(out)
    if out.exists() and not overwrite:
        raise CalibrationError(f"{out} already exists (choose another -o or remove it)")
    start = time.perf_counter()
    torch.manual_seed(seed)
    rotation = recipe.rotation
    loaded = load_model(model_id, device)
    tokenizer, model, source_dtype, local = loaded.tokenizer, loaded.model, loaded.source_dtype, loaded.local
    spec = spec_for_model(model)      # fail early on an unsupported architecture
    if budget is not None:            # and on a budget it cannot meet by construction
        from ascend_quant.calibration import budget as budgets
        budgets.fallback_for(recipe, budget)
        if recipe.online_rotation is not None and recipe.online_rotation.where_supported:
            say("no online rotation: the quality budget's mixed model has none yet")
            recipe = replace(recipe, online_rotation=None)
        budgets.check_supported(recipe, spec)
    # layers stored after the model's own (MTP): copied as they are (refused now if quantized)
    source_files = loaded.stream.files if loaded.stream is not None else _weight_files(local)
    extra = extra_layer_tensors(model, source_files, source_dtype) if source_files else {}
    rotated = skipped_rotation = None
    if rotation is not None and rotation.where_supported:
        skipped_rotation = rotation_refusal(model, spec, rotation.kind, rotation.r2)
    if skipped_rotation:              # a preset's rotation where the family takes none: unrotated
        why = skipped_rotation.split("no offline rotation: ", 1)[-1].removesuffix("; calibrate without rotation")
        say(f"not rotated: {why}")
        recipe = replace(recipe, rotation=None)
    elif rotation is not None:
        rotated = rotated_model(loaded, spec, rotation)
        if recipe.smoothquant is not None and not recipe.smoothquant.rotated:
            say("no SmoothQuant: the model is rotated (smoothquant.rotated: false)")
            recipe = replace(recipe, smoothquant=None)
        if recipe.awq is not None and not recipe.awq.rotated:
            say("no AWQ: the model is rotated (awq.rotated: false)")
            recipe = replace(recipe, awq=None)
    online = recipe.online_rotation
    skipped_online = online_refusal(model, spec) if online is not None else None
    if skipped_online and not online.where_supported:
        raise CalibrationError(skipped_online)
    if skipped_online:
        say(f"no online rotation: {skipped_online.split(': ', 1)[-1]}")
        recipe = replace(recipe, online_rotation=None)
    unrotated = recipe.gptq.float_target_unrotated
    if recipe.gptq.float_target and rotated is None and unrotated < 1:
        if not unrotated:
            say("GPTQ fits each Linear's own output: the model is not rotated (gptq.float_target_unrotated: false)")
            recipe = replace(recipe, gptq=replace(recipe.gptq, float_target=False))
        else:
            say(f"GPTQ starts {unrotated:g} of the way to the float target's fit: the model is not rotated "
                f"(gptq.float_target_unrotated: {unrotated:g})")
            recipe = replace(recipe, gptq=replace(recipe.gptq, float_target_share=unrotated))
    if recipe.awq is not None and not recipe.awq.moe and spec.moe is not None:
        say("no AWQ: a Mixture-of-Experts model (awq.moe: false)")
        recipe = replace(recipe, awq=None)
    texts = load_texts(dataset, "calibration")
    # msModelSlim's per-sample observers (running ranges, last-sample C8) need one sample per row
    per_sample = recipe.activations.observer == "running" or (
        recipe.kv_cache is not None and recipe.kv_cache.method == "msmodelslim")
    samples, valid, position_ids = tokenize_samples(texts, tokenizer, num_samples, seq_len, seed, chat_template,
                                                    packing, share_rows=not per_sample)
    del texts                         # the tokenizer's work is done: let it and the texts go
    loaded.tokenizer = tokenizer = None
    budget_report = None
    if budget is not None:
        calib, held = budgets.split_rows(Samples(samples, valid, position_ids))
        samples, valid, position_ids = calib
    n_samples = int(((position_ids == 0) & valid).sum())
    num_layers = len(spec.layers(model))

    def quantize(ld: LoadedModel, rec: Recipe, spill=None):
        bar = None
        if show_progress:
            from tqdm import tqdm
            bar = tqdm(total=num_layers, desc="calibrating", unit="layer")

        def progress(report: LayerReport) -> None:
            if bar is not None:
                worst = max(report.errors.values(), default=0.0)
                bar.set_postfix_str(f"layer {report.index} worst rel. error {worst:.4f}")
                bar.update(1)
        try:
            return quantize_model(ld.model, samples.to(device), rec, progress, valid, release_weights=True,
                                  position_ids=position_ids.to(device), stream=ld.stream, spill=spill)
        finally:
            if bar is not None:
                bar.close()

    # each finished layer's quantized tensors wait on disk, beside the output, until it is written
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.spill-", dir=out.parent) as spill_dir:
        spilled = None
        if budget is None:
            spilled = LayerSpill(Path(spill_dir), spec, source_dtype)
            results, kv_scales, reports = quantize(loaded, recipe, spilled)
        else:
            # no spill: the budget's mixed model reads every calibration's quantized Linears
            unused = [loaded]

            def calibrate_on(rec: Recipe):
                if unused:
                    ld = unused.pop()
                else:                            # a fresh model, rotated as the first one was
                    ld = load_model(model_id, device)
                    if rotated is not None:
                        rotated_model(ld, spec, rotation)
                return budgets.Run(ld, *quantize(ld, rec))

            def float_model():                   # the mixed model's float Linears: rotated as calibrated
                ld = load_model(model_id, device, stream=False)
                if rotated is not None:
                    rotated_model(ld, spec, rotation)
                return ld.model

            recipe, run, budget_report = budgets.select(
                recipe, budget, spec, Samples(held.ids.to(device), held.valid.to(device), held.position_ids.to(device)),
                source_dtype, calibrate_on, float_model, say)
            loaded, results, kv_scales, reports = run.loaded, run.results, run.kv_scales, run.reports
            model = loaded.model
        tensors, types = checkpoint_tensors(model, results, kv_scales, source_dtype, spilled)
        tensors.update(extra)
        types.update({n: FLOAT.name for n in extra})
        schemes = {**(spilled.schemes if spilled is not None else {}),
                   **{prefix: q.scheme for prefix, q in results.items()}}
        config = config_with_quant_method(read_json(local / "config.json"), moe_hints(model, schemes))
        if spec.discovered:               # the checkpoint tools and vLLM read it back (spec_for_config)
            config[SAVED_SPEC_KEY] = spec.to_dict()
        if spec.variant is not None:      # the key the spec was chosen by, where the source's config omits it
            inner = config["text_config"] if isinstance(config.get("text_config"), dict) else config
            inner.setdefault(spec.variant[0], config_get(model.config, spec.variant[0]))
        if rotated is not None:           # lm_head has its own (rotated) weight now
            untie_config(config)
        base_model, license_ = source_identity(model_id, local)
        meta = {"tool": "ascend-quant", "base_model": base_model, "license": license_,
                "num_samples": n_samples, "seq_len": int(seq_len),
                "dataset": _dataset_name(dataset), "seed": seed}
        files = {"ascend_quant_recipe.yaml": recipe.to_yaml(),
                 "ascend_quant_calibration.json": json.dumps(
                     {**meta, "seconds": round(time.perf_counter() - start, 2), "arch_spec": spec.name,
                      **({"rotation": rotated} if rotated is not None else {}),
                      **({"rotation_skipped": skipped_rotation} if skipped_rotation else {}),
                      **({"online_rotation": {"linears": spec.mlp.down, "kind": "hadamard",
                                              "seed": recipe.online_rotation.seed}}
                         if recipe.online_rotation is not None else {}),
                      **({"online_rotation_skipped": skipped_online} if skipped_online else {}),
                      **({"budget": budget_report} if budget_report is not None else {}),
                      "layers": [{"index": r.index, "seconds": round(r.seconds, 3), "schemes": r.schemes,
                                  "errors": r.errors, "smoothquant_alphas": r.alphas,
                                  **({"awq_alphas": r.awq_alphas} if r.awq_alphas else {}),
                                  **({"clip_ratios": r.clip_ratios} if r.clip_ratios else {}),
                                  **({"tune": {"error_before": r.tune.before, "error_after": r.tune.after,
                                               "kept": r.tune.kept, "codes_moved": r.tune.moved}}
                                     if r.tune is not None else {}),
                                  **({"expert_tokens": r.expert_tokens, "expert_fallbacks": r.fallbacks}
                                     if r.expert_tokens else {})} for r in reports]}, indent=2)}
        files.update(extra_files or {})
        group_size = group_size_for(recipe, schemes)
        def loader(name: str) -> torch.Tensor:              # a placeholder's values, in its dtype
            if spilled is not None and name in spilled.where:
                return spilled.read(name)
            dtype = tensors[name].dtype
            model_name = loaded.stream.spec.from_disk(name) if loaded.stream is not None else None
            if model_name in getattr(loaded.stream, "sources", {}):           # by its model name
                return loaded.stream.read([model_name], dtype, mapped=True)[model_name]
            return source_files.read([name], dtype, mapped=True)[name]         # an extra layer's, as stored
        write_checkpoint(out, tensors, types, group_size=group_size, source_dir=local, config=config,
                         metadata=meta, extra_files=files, overwrite=overwrite, loader=loader)
    if budget_report is not None:     # the size, as `inspect` prices it, into the calibration record
        _record_size(out, budget_report)
    return CalibrationResult(out, time.perf_counter() - start, n_samples, seq_len, reports, spec, budget_report)


def _record_size(out: Path, report: dict) -> None:
    from ascend_quant.formats.ascend import read_checkpoint
    from ascend_quant.formats.inspect import summarize

    summary = summarize(read_checkpoint(out))
    report["size"] = {**{k: summary["totals"][k] for k in ("bytes", "float_bytes", "ratio")},
                      "float_dtype": summary["float_dtype"]}
    path = out / "ascend_quant_calibration.json"
    record = read_json(path)
    record["budget"] = report
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def _weight_files(folder: Path):
    """The source's safetensors index, or None (no safetensors: nothing beyond the model is read)."""
    from ascend_quant.calibration.streaming import StreamingUnavailable, WeightFiles
    try:
        return WeightFiles(folder)
    except StreamingUnavailable:
        return None


def _dataset_name(dataset: str | None) -> str:
    """How the calibration record (and the card) names the data: a Hub dataset by id, a local
    file by its name only."""
    if not dataset:
        return "built-in wiki text (Wikipedia lead sections, calibration split)"
    return Path(dataset).name if Path(dataset).exists() else dataset


def group_size_for(recipe: Recipe, schemes: dict[str, str]) -> int:
    return recipe.group_size if any(SCHEMES[s].packed for s in schemes.values()) else 0


def source_identity(model_id: str, local: Path) -> tuple[str | None, str | None]:
    """(base model id, license) of the source model: a Hub id names itself; a local folder is
    named by its card's `model_name` or config's `_name_or_path` when that looks like a Hub id."""
    license_ = name = None
    card = local / "README.md"
    if card.is_file():
        try:
            from huggingface_hub import ModelCard
            data = ModelCard.load(card).data.to_dict()
            license_, name = data.get("license"), data.get("model_name")
        except Exception:      # a malformed card of the source model is not our error
            pass
    if not Path(model_id).exists():
        return model_id, license_
    cfg_name = read_json(local / "config.json").get("_name_or_path", "")
    if not name and re.fullmatch(r"[\w.-]+/[\w.-]+", cfg_name or "") and not Path(cfg_name).exists():
        name = cfg_name
    return name or local.name, license_
