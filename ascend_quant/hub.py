"""Publishing: the model card of a checkpoint and its upload to the Hugging Face Hub.

The card (`README.md` with YAML metadata, through `huggingface_hub.ModelCard`) says how the
checkpoint was made (scheme per layer type, recipe, calibration data), how good it is
(`eval_results.json`, when `ascend-quant eval` has run) and how to serve it. The
`calibrate` command writes it once the checkpoint is written (calibration itself does not);
`upload` refreshes it and sends the checkpoint's own files in one commit. Tokens come from
huggingface_hub's usual places and are never printed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ascend_quant.formats.ascend import (INDEX_NAME, MODEL_SIDE_FILES, CheckpointError,
                                         read_checkpoint)
from ascend_quant.schemes import C8, FLOAT, SCHEMES, is_float, is_kv

CARD_NAME = "README.md"
RECIPE_NAME = "ascend_quant_recipe.yaml"
CALIBRATION_NAME = "ascend_quant_calibration.json"
EVAL_NAME = "eval_results.json"
OUR_FILES = (RECIPE_NAME, CALIBRATION_NAME, EVAL_NAME, CARD_NAME)


class HubError(Exception):
    """An upload that cannot go on; the message is one line and never holds a token."""


# ------------------------------------------------------------------------- files

def checkpoint_files(folder: str | Path) -> tuple[list[Path], list[Path]]:
    """(files that belong to the checkpoint, files that do not). Only the description, the
    quantized weights (+ index), config/tokenizer files and our own records are published:
    never float weights, caches or temp folders."""
    folder = Path(folder)
    ckpt = read_checkpoint(folder)
    keep = {ckpt.description_file, *ckpt.weight_files}
    for name in (INDEX_NAME, *MODEL_SIDE_FILES, *OUR_FILES):
        if (folder / name).is_file():
            keep.add(folder / name)
    everything = sorted(p for p in folder.rglob("*") if p.is_file())
    return sorted(keep), [p for p in everything if p not in keep]


# -------------------------------------------------------------------------- card

def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def schemes_by_layer_type(description: dict[str, str]) -> dict[str, str]:
    """Layer type (q_proj, down_proj, lm_head, ...) -> its scheme(s), e.g. {'q_proj': 'W8A8'}."""
    out: dict[str, set[str]] = {}
    for name, qtype in description.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix != "weight":
            continue
        leaf = prefix.rpartition(".")[2] or prefix
        if "norm" in leaf:          # norms stay float in every scheme
            continue
        out.setdefault(leaf, set()).add(qtype)
    return {k: "/".join(sorted(v)) for k, v in out.items()}


def model_card(folder: str | Path, repo_id: str | None = None):
    """The ModelCard of a checkpoint folder, from the files in it, titled `repo_id` or else
    `<base model>-<scheme>` (the folder's name when the base model is not recorded)."""
    folder = Path(folder)
    ckpt = read_checkpoint(folder)
    recipe = (folder / RECIPE_NAME).read_text() if (folder / RECIPE_NAME).is_file() else None
    calib = _read_json(folder / CALIBRATION_NAME) or {}
    base = {**(ckpt.meta.get("metadata") or {}), **calib}.get("base_model")
    name = repo_id or (f"{str(base).rpartition('/')[2]}-{ckpt.meta.get('model_quant_type', FLOAT.name)}"
                       if base else folder.name)
    return render_card(ckpt.description, ckpt.meta, calib, recipe, _read_json(folder / EVAL_NAME), name)


def render_card(description: dict[str, str], meta: dict, calib: dict, recipe: str | None,
                evals: dict | None, name: str):
    """The card (YAML metadata + text) from a checkpoint's description, top-level keys,
    calibration record, recipe and eval results."""
    from huggingface_hub import ModelCard, ModelCardData

    scheme = meta.get("model_quant_type", FLOAT.name)
    group_size = int(meta.get("group_size", 0) or 0)
    kv_int8 = meta.get("kv_cache_type") == C8.name or any(is_kv(t) for t in description.values())
    calib = {**(meta.get("metadata") or {}), **calib}
    base = calib.get("base_model")
    tags = ["ascend", "vllm", "quantized", "msmodelslim-format", scheme.lower().replace("_", "-")]
    if kv_int8:
        tags.append("int8-kv-cache")
    data = ModelCardData(base_model=base, library_name="vllm", license=calib.get("license") or None,
                         tags=tags, pipeline_tag="text-generation")
    by_type = schemes_by_layer_type(description)
    lines = [f"# {name}", "",
             f"{base or 'A causal LM'} quantized to **{scheme}** for Huawei Ascend NPUs with ascend-quant, in the "
             "layout msModelSlim writes and vllm-ascend's `--quantization ascend` reads.", "",
             "## Quantization", "", "| layer type | scheme | weights | activations |", "|---|---|---|---|"]
    for leaf, s in by_type.items():
        info = SCHEMES.get(s.split("/")[0])
        w = f"int{info.weight_bits}" if info and info.weight_bits else "float"
        a = f"int{info.activation_bits} {info.activation_mode}" if info and info.activation_bits else "float"
        lines.append(f"| `{leaf}` | {s} | {w} | {a} |")
    lines += ["", f"Group size: {group_size or 'per channel'}. KV cache: "
              f"{'int8 (C8, per-channel scales on post-RoPE K/V)' if kv_int8 else 'model dtype'}."]
    if "num_samples" in calib:
        seconds = f", {calib['seconds']} s" if "seconds" in calib else ""
        lines += ["", "## Calibration", "",
                  f"{calib['num_samples']} samples x {calib.get('seq_len', '?')} tokens of "
                  f"{calib.get('dataset', '?')} (seed {calib.get('seed', 0)}){seconds}."]
    rot = calib.get("rotation")
    if isinstance(rot, dict):
        r2 = f", R2 per KV head (head_dim {rot.get('head_dim')})" if rot.get("r2") else ""
        untied = "; lm_head untied from the embeddings" if rot.get("untied_embeddings") else ""
        lines += ["", f"Rotated first, folded into the weights offline: R1 {rot.get('kind')} on the "
                      f"residual stream (hidden {rot.get('hidden_size')}){r2}; norm gains folded into the Linears, "
                      f"so the norms are all ones{untied}."]
    online = calib.get("online_rotation")
    if isinstance(online, dict):
        lines += ["", f"Online rotation: a randomized Hadamard on the input of every `{online.get('linears')}` at "
                      "inference (its signs stored as `input_rotation`, its weight as w·Q). Served by ascend-quant's "
                      "runtime at tensor-parallel size 1; vllm-ascend does not load this checkpoint."]
    if recipe:
        lines += ["", "Recipe (`ascend_quant_recipe.yaml`, reusable with `ascend-quant calibrate --recipe`):", "",
                  "```yaml", recipe.rstrip(), "```"]
    if evals:
        lines += ["", "## Quality", "",
                  f"Perplexity on {evals['tokens']} tokens of {evals['dataset']} (context {evals['seq_len']}); "
                  "the quantized model runs the exact reference arithmetic of the NPU kernels:", "",
                  "| model | perplexity | delta |", "|---|---|---|",
                  f"| float | {evals['float_ppl']:.4f} | |",
                  f"| {scheme} | {evals['quantized_ppl']:.4f} | {evals['delta']:+.2%} |"]
    lines += ["", "## Serving", "", "```bash", "pip install 'ascend-quant[vllm]'",
              f"vllm serve {name} --quantization ascend", f"# or: ascend-quant serve {name}", "```", "",
              "On Ascend hosts with vllm-ascend installed, vllm-ascend's own `ascend` method serves the schemes it "
              "supports."]
    notes = sorted({f"{s}: {SCHEMES[s].served_by_vllm_ascend}" for v in by_type.values() for s in v.split("/")
                    if s in SCHEMES and not is_float(s)})
    if kv_int8:
        notes.append(f"{C8.name}: {C8.served_by_vllm_ascend}")
    if notes:
        lines += ["", "vllm-ascend 0.23 support for what this checkpoint holds: " + "; ".join(notes) + "."]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def write_card(folder: str | Path, repo_id: str | None = None) -> Path:
    path = Path(folder) / CARD_NAME
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(str(model_card(folder, repo_id)))
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------ upload

@dataclass
class UploadPlan:
    repo_id: str
    files: list[Path]
    skipped: list[Path]
    card: str

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def plan_upload(folder: str | Path, repo_id: str) -> UploadPlan:
    """What `upload` would send; refreshes the card in the folder first."""
    try:
        write_card(folder, repo_id)
        files, skipped = checkpoint_files(folder)
    except CheckpointError as e:
        raise HubError(str(e)) from None
    return UploadPlan(repo_id, files, skipped, (Path(folder) / CARD_NAME).read_text())


def upload(plan: UploadPlan, folder: str | Path, private: bool = False, revision: str | None = None,
           commit_message: str | None = None) -> str:
    """Create the repo if needed and send the planned files in one commit. Returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    folder = Path(folder)
    names = [str(p.relative_to(folder)) for p in plan.files]
    try:
        api.create_repo(plan.repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(plan.repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=plan.repo_id, folder_path=str(folder), revision=revision,
                                 allow_patterns=names,
                                 commit_message=commit_message or f"Upload {plan.repo_id} (ascend-quant)")
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"the Hub refused the upload to {plan.repo_id} (HTTP {status}): set HF_TOKEN or run "
                           "`hf auth login` with a token that can write there") from None
        raise HubError(f"the Hub answered HTTP {status} for {plan.repo_id}: {_redact(str(e).splitlines()[0])}") from None
    except (OSError, ConnectionError) as e:
        raise HubError(f"cannot reach the Hugging Face Hub ({type(e).__name__}); nothing was uploaded") from None
    except Exception as e:
        if type(e).__name__ in ("ConnectError", "ConnectTimeout", "OfflineModeIsEnabled", "LocalEntryNotFoundError"):
            raise HubError(f"cannot reach the Hugging Face Hub ({type(e).__name__}); nothing was uploaded") from None
        raise
    return str(getattr(info, "commit_url", info))


_TOKEN_RE = re.compile(r"hf_[A-Za-z0-9]{8,}")


def _redact(text: str) -> str:
    return _TOKEN_RE.sub("hf_***", text)
