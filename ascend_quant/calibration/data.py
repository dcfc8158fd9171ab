"""Calibration and evaluation text: load it, tokenize it, pack it into fixed-length samples.

Sources: the built-in wiki text (`None` or "wiki"), a local .txt / .jsonl / .json / .parquet
file (msModelSlim's `inputs_pretokenized` jsonl included), or a Hugging Face Hub dataset
name, all through `datasets`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import torch

TEXT_KEYS = ("text", "inputs_pretokenized", "content", "prompt", "extract")
FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class Samples(NamedTuple):
    """Calibration tokens as rows of a batch."""
    ids: torch.Tensor            # [R, L] token ids
    valid: torch.Tensor          # [R, L] bool: real tokens (False: padding)
    position_ids: torch.Tensor   # [R, L]: restarts at 0 where a new sample begins inside a row


class DataError(Exception):
    """Unusable calibration data; the message names the source and why."""


def load_texts(source: str | None, split: str = "calibration") -> list[str]:
    """Texts of a dataset. `split` applies to the built-in wiki text (calibration / eval)."""
    if source in (None, "", "wiki"):
        from ascend_quant.assets import wiki_paragraphs
        return wiki_paragraphs(split)
    path = Path(source)
    if path.exists():
        return _local_texts(path)
    if source.startswith((".", "/")) or Path(source).suffix in FORMATS:
        raise DataError(f"{source}: no such file")
    return _hub_texts(source)


def _local_texts(path: Path) -> list[str]:
    import datasets

    files = sorted(p for p in path.iterdir() if p.suffix in FORMATS) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: no .txt, .jsonl, .json or .parquet files")
    kinds = {FORMATS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise DataError(f"{path}: use one of .txt, .jsonl, .json, .parquet (got {sorted(f.suffix for f in files)})")
    kind = kinds.pop()
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"{path}: the dataset is empty")
    try:
        if kind == "text":
            # paragraphs separated by blank lines are one sample each
            texts = []
            for f in files:
                texts += [p.strip() for p in f.read_text(encoding="utf-8").split("\n\n")]
            return [t for t in texts if t]
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except DataError:
        raise
    except Exception as e:  # datasets raises many types for malformed files
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"{path}: cannot be read as {kind} ({type(e).__name__}: {detail})") from None
    return _column(ds, str(path))


def _hub_texts(name: str) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:
        raise DataError(f"dataset {name!r} is neither a local file nor reachable on the Hugging Face Hub "
                        f"({type(e).__name__}); pass a local .txt/.jsonl/.parquet file") from None
    return _column(ds, name)


def _column(ds, where: str) -> list[str]:
    for key in TEXT_KEYS:
        if key in ds.column_names:
            return [t for t in ds[key] if isinstance(t, str) and t.strip()]
    raise DataError(f"{where}: no text column (looked for {', '.join(TEXT_KEYS)}; has {ds.column_names})")


def bos_prefix(tokenizer) -> list[int]:
    """`[bos_token_id]` when the tokenizer starts every text it encodes with BOS, else `[]`.

    Gemma's perplexity doubles without BOS (about 14.7 with, 31 without, on the wiki text);
    SmolLM2's tokenizer adds none and its samples stay as they were. The tokenizer is the
    one source of truth, not the arch spec: BOS is a property of how a checkpoint was
    trained, which its tokenizer records (`add_bos_token`, or a post-processor template),
    and it differs within a family (SmolLM2 and Llama-3 share the Llama layout, only
    Llama-3 adds BOS). Samples and windows are encoded without special tokens and then
    given this prefix, so a chat template's own BOS is not doubled.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    return [bos] if tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos] else []


def tokenize_samples(texts: list[str], tokenizer, num_samples: int, seq_len: int, seed: int = 0,
                     chat_template: bool = False, packing: bool = True, share_rows: bool = False
                     ) -> Samples:
    """Calibration samples as rows of token ids, with a valid mask and position ids.

    With `packing` the texts are shuffled (fixed seed), tokenized, concatenated with EOS
    between documents and cut into `seq_len` windows (every token valid). Without it, each
    text is one sample in file order, truncated to `seq_len`: one sample per row,
    right-padded to the longest (padding not valid); with `share_rows` short samples are
    bin-packed several to a row instead (position ids restart at each sample, so
    transformers gives every sample its own causal block: the same computation as one row
    each), and the few tokens of room left in a row are end-of-text tokens closing its last
    sample, counted as real (then every statistic works on views, with no masked copies).
    Where the tokenizer adds BOS (`bos_prefix`) every sample and every packed window starts
    with it (a packed window then holds `seq_len - 1` text tokens).
    Raises DataError when the data cannot fill even one sample.
    """
    if not texts:
        raise DataError("the dataset has no text")
    bos = bos_prefix(tokenizer)

    def encode(text: str) -> list[int]:
        if chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if not packing:
        def with_bos(ids: list[int]) -> list[int]:     # a chat template may have written it already
            return ids if not ids or ids[:len(bos)] == bos else bos + ids
        docs = [with_bos(ids)[:seq_len] for ids in (encode(t) for t in texts[:num_samples]) if ids]
        if not docs:
            raise DataError("the dataset has no tokens")
        rows = _share_rows(docs) if share_rows else [[d] for d in docs]
        width = max(sum(len(d) for d in row) for row in rows)
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        positions = torch.arange(width).repeat(len(rows), 1)
        for i, row in enumerate(rows):
            at = 0
            for d in row:
                ids[i, at:at + len(d)] = torch.tensor(d)
                mask[i, at:at + len(d)] = True
                positions[i, at:] = torch.arange(width - at)    # padding continues the last sample
                at += len(d)
            if share_rows:          # the room left: end-of-text tokens closing the row's last sample
                mask[i, at:] = True
        return Samples(ids, mask, positions)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    width = seq_len - len(bos)          # text tokens per window
    need = num_samples * width
    ids_: list[int] = []
    for i in order:
        ids_ += encode(texts[i]) + sep
        if len(ids_) >= need:
            break
    available = len(ids_) // width if width > 0 else 0
    if available == 0:
        raise DataError(f"the dataset holds {len(ids_)} tokens, fewer than one sample of --seq-len {seq_len}")
    if available < num_samples:
        import warnings
        warnings.warn(f"the dataset fills only {available} of {num_samples} samples of {seq_len} tokens")
    n = min(available, num_samples)
    ids = _windows(ids_, bos, n, width)
    return Samples(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(seq_len).repeat(n, 1))


def _share_rows(docs: list[list[int]]) -> list[list[list[int]]]:
    """First-fit decreasing: rows as wide as the longest sample, filled with the others."""
    width = max(len(d) for d in docs)
    rows: list[list[list[int]]] = []
    room: list[int] = []
    for d in sorted(docs, key=len, reverse=True):
        slot = next((i for i, r in enumerate(room) if r >= len(d)), None)
        if slot is None:
            rows.append([])
            room.append(width)
            slot = len(rows) - 1
        rows[slot].append(d)
        room[slot] -= len(d)
    return rows


def _windows(ids: list[int], bos: list[int], n: int, width: int) -> torch.Tensor:
    """[n, len(bos) + width]: consecutive `width`-token pieces of `ids`, each after `bos`."""
    body = torch.tensor(ids[: n * width], dtype=torch.long).reshape(n, width)
    return torch.cat([torch.tensor(bos, dtype=torch.long).expand(n, len(bos)), body], dim=1) if bos else body


def eval_windows(texts: list[str], tokenizer, tokens: int, seq_len: int) -> torch.Tensor:
    """The texts in order (joined by blank lines) as non-overlapping windows of `seq_len`,
    at most `tokens` tokens in all: [tokens // seq_len, seq_len]. Where the tokenizer adds
    BOS (`bos_prefix`) each window is BOS and the next `seq_len - 1` text tokens."""
    bos = bos_prefix(tokenizer)
    width = seq_len - len(bos)
    n_max = tokens // seq_len
    ids: list[int] = []
    for text in texts:
        ids += tokenizer("\n\n" + text if ids else text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_max * width:
            break
    n = min(n_max, len(ids) // width) if width > 0 else 0
    if n == 0:
        raise DataError(f"the evaluation text holds {len(ids)} tokens, fewer than one window of {seq_len}")
    return _windows(ids, bos, n, width)
