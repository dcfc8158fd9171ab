"""Perplexity over fixed windows (no sliding overlap): exp(mean next-token NLL)."""

from __future__ import annotations

import math

import torch


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4) -> float:
    """windows: [num_windows, seq_len] token ids. Every window is scored independently
    (its first token has no context and is not scored)."""
    total_nll, total_tokens = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start:start + batch_size]
        logits = model(input_ids=batch).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    value = math.exp(total_nll / total_tokens)
    if not math.isfinite(value):
        raise FloatingPointError("perplexity is not finite (NaN or overflow in the model's logits)")
    return value
