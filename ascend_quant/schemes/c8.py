"""C8: the int8 KV cache. Per-channel symmetric scales of the post-RoPE keys and values,
stored on the K and V projections as `kv_cache_scale` / `kv_cache_offset` (float32,
[kv_heads * head_dim]; offsets zero)."""

from __future__ import annotations

import torch

from ascend_quant.schemes.base import Scheme

KV_SUFFIXES = ("kv_cache_scale", "kv_cache_offset")


class C8(Scheme):
    name = "C8"
    activation_bits = 8
    activation_mode = "static"
    kv_cache = True
    served_by_vllm_ascend = "Qwen3, GLM4-MoE and MiniMax-M2 model classes only"

    def pack_kv(self, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"kv_cache_scale": scale.float(), "kv_cache_offset": torch.zeros_like(scale, dtype=torch.float32)}


SCHEME = C8()
