"""See or change post-RoPE keys and values of a transformers model, through its AttentionInterface.

What the KV cache stores is the key after RoPE, which only the attention function sees.
`wrap_attention(model, hook)` registers an attention function that calls
`hook(module, key, value) -> (key, value)` and then the model's own implementation (sdpa,
eager, ...), and switches the model to it until the context exits. Keys and values arrive as
[batch, kv_heads, seq, head_dim]; `module.layer_idx` says which layer. With a KV cache the
hook sees the whole cached sequence each step, so observers should run with `use_cache=False`.

    with wrap_attention(model, observe):          # calibration: observe K/V
        model(input_ids, use_cache=False)
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

KVHook = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]
_counter = itertools.count()


def kv_channels(key: torch.Tensor) -> torch.Tensor:
    """[batch, kv_heads, seq, head_dim] -> [batch * seq, kv_heads * head_dim], the channel order
    of the C8 scales (index h * head_dim + d)."""
    b, h, s, d = key.shape
    return key.transpose(1, 2).reshape(b * s, h * d)


def install_attention_hook(model: torch.nn.Module, hook: KVHook) -> tuple[str, str]:
    """Register `hook` in front of the model's attention implementation and switch the model
    to it. Returns (new name, previous name); `model.set_attn_implementation(previous)` undoes it."""
    previous = model.config._attn_implementation or "sdpa"
    # sdpa has no attention logit softcap and drops the argument: a softcapped model (Gemma-2)
    # runs its own eager function, which applies it as vLLM does, with eager's additive mask
    softcap = getattr(model.config, "attn_logit_softcapping", None) is not None
    runs = "eager" if softcap else previous
    inner = ALL_ATTENTION_FUNCTIONS[runs] if runs != "eager" else None

    def attention(module, query, key, value, attention_mask, **kwargs):
        out = hook(module, key, value)
        if out is not None:
            key, value = out
        return (inner or eager_attention_of(module))(module, query, key, value, attention_mask, **kwargs)

    name = f"ascend_quant_hook_{next(_counter)}"
    AttentionInterface.register(name, attention)
    # and the same mask as before: without one registered under the new name transformers
    # builds no mask at all (plain causal), dropping padding and packed-sample masks
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[runs])
    model.set_attn_implementation(name)
    return name, previous


def eager_attention_of(module: torch.nn.Module) -> Callable:
    """The eager attention function of the module's own modeling file (Gemma-2's applies the
    attention logit softcap, which Llama's does not); Llama's where the file has none."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as own
    return own


@contextlib.contextmanager
def wrap_attention(model: torch.nn.Module, hook: KVHook):
    """Run `hook` on every attention call's post-RoPE key/value inside the block."""
    _, previous = install_attention_hook(model, hook)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
