"""C8 (int8 KV cache) inside vLLM: the attention layer's quant method and the attention impl
that owns the int8 pages.

`AscendC8KVCacheMethod.create_weights(layer)` runs at the end of `Attention.__init__`:
  * `layer.kv_cache_torch_dtype = torch.int8` — vLLM's `get_kv_cache_spec` sizes pages from
    it, so a page costs half the bytes of bf16 and the block manager allocates about twice the
    blocks. The `kv_cache_dtype` string stays "auto" (0.32 has no "int8"; "fp8" would switch
    on fp8 handling elsewhere).
  * parameters `k_cache_scale`, `v_cache_scale`, `k_cache_offset`, `v_cache_offset`,
    [num_kv_heads * head_dim] of this rank (the checkpoint's `k_proj.kv_cache_scale` etc. are
    renamed by the config's weight mapper; the loader narrows them by KV head under tensor
    parallelism, with replication when there are fewer KV heads than ranks).
  * `layer.impl.__class__` becomes `AscendC8AttentionImpl`: the CPU platform always picks
    CPU_ATTN and a custom backend is not selectable there, so the impl is swapped in place
    (its metadata builder, block size and scheduler stay upstream's). The upstream C++ kernels
    never see int8 pages (they take one float scale and use their own page layout).

The impl writes with `paged.c8.write` (quantize into `slot_mapping`) and reads with
`paged.c8.attention` (native C kernel on CPUs, batched torch otherwise): see that module.
Sliding-window layers (vLLM's int `sliding_window`: keys in (p - W, p]) and the logits soft-cap
(Gemma-2) are passed through to it; ALiBi, attention sinks and non-decoder attention are refused.
"""

from __future__ import annotations

import torch

from ascend_quant.runtime.paged import c8 as paged
from ascend_quant.schemes import C8

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.utils import set_weight_attrs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

# under vLLM's logger, so the lines reach the serving log (vLLM configures only "vllm.*")
logger = init_logger("vllm.ascend_quant.attention")

SCALE_PARAMS = ("k_cache_scale", "v_cache_scale", "k_cache_offset", "v_cache_offset")


def _kv_head_loader(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy this rank's KV heads of a [total_kv_heads * head_dim] C8 vector."""
    local = param.numel()
    loaded = loaded.reshape(-1).float()
    if loaded.numel() == local:
        param.data.copy_(loaded)
        return
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    head_dim = param.c8_head_dim
    total_heads = loaded.numel() // head_dim
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    if total_heads >= size:
        start = rank * local
    else:                                        # fewer KV heads than ranks: heads are replicated
        start = (rank // (size // total_heads)) * head_dim
    if start + local > loaded.numel():
        raise ValueError(f"C8 scale of {loaded.numel()} values does not hold rank {rank}'s {local}")
    param.data.copy_(loaded[start:start + local])


class AscendC8KVCacheMethod(BaseKVCacheMethod):
    """An attention layer whose KV cache is int8 with the checkpoint's per-channel scales."""

    def __init__(self, quant_config, prefix: str):
        super().__init__(quant_config)
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module) -> None:
        impl = layer.impl
        if not isinstance(impl, CPUAttentionBackendImpl):
            raise NotImplementedError(
                f"{self.prefix}: the C8 int8 KV cache is implemented for vLLM's CPU attention backend; "
                f"this platform uses {type(impl).__name__} (on Ascend NPUs serve with vllm-ascend)")
        window = impl.sliding_window
        unsupported = {f"sliding window {window!r} (an int window is supported)":
                           window is not None and (not isinstance(window, int) or isinstance(window, bool)),
                       "ALiBi": impl.alibi_slopes is not None,
                       "attention sinks": impl.sinks is not None,
                       "non-decoder attention": impl.attn_type != AttentionType.DECODER}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"{self.prefix}: C8 int8 KV cache with {', '.join(bad)} is not supported")
        layer.kv_cache_torch_dtype = torch.int8
        n = layer.num_kv_heads * layer.head_size
        for name in SCALE_PARAMS:
            fill = 1.0 if name.endswith("scale") else 0.0
            p = torch.nn.Parameter(torch.full((n,), fill, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(p, {"weight_loader": _kv_head_loader, "c8_head_dim": layer.head_size})
            layer.register_parameter(name, p)
        impl.__class__ = AscendC8AttentionImpl
        impl.c8_layer_name = self.prefix

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name in ("k_cache_offset", "v_cache_offset"):
            if torch.any(getattr(layer, name) != 0):
                raise ValueError(f"{self.prefix}: nonzero C8 {name}: only symmetric int8 KV caches are served "
                                 "(the NPU decode path ignores the offset too)")
        from ascend_quant.formats.checks import tensor_problems

        for name in ("k_cache_scale", "v_cache_scale"):
            problems = tensor_problems(f"{self.prefix}.{name}", C8.name, getattr(layer, name).data)
            if problems:
                raise ValueError(problems[0])
        layer.impl.c8_prepare(layer.k_cache_scale.data, layer.v_cache_scale.data)


class AscendC8AttentionImpl(CPUAttentionBackendImpl):
    """CPU attention over int8 pages (set on C8 layers by `AscendC8KVCacheMethod`)."""

    _logged = False

    def c8_prepare(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        self.c8_k_scale = k_scale.float().contiguous()
        self.c8_v_scale = v_scale.float().contiguous()
        self.c8_folded = paged.fold_scales(self.c8_k_scale, self.c8_v_scale, self.num_heads, self.num_kv_heads,
                                           self.scale)
        self.c8_impl = paged.choose_impl()

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache.numel() == 0:
            return
        if self.c8_impl == "native":
            paged.write_native(kv_cache, key, value, slot_mapping, self.c8_k_scale, self.c8_v_scale)
        else:
            paged.write_reference(kv_cache, key, value, slot_mapping, self.c8_k_scale, self.c8_v_scale)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported with the C8 KV cache")
        if attn_metadata is None:                       # warm-up
            return output
        if attn_metadata.dynamic_causal is not None:
            raise NotImplementedError("C8 KV cache: dynamic causal masks are not supported")
        if not AscendC8AttentionImpl._logged:
            AscendC8AttentionImpl._logged = True
            nb, _, bs, _ = kv_cache.shape
            logger.info("ascend-quant: KV cache int8 (C8): %d blocks x %d = %s tokens fit; C8 attention kernel: %s",
                        nb, bs, f"{nb * bs:,}", self.c8_impl)
        t = attn_metadata.num_actual_tokens
        q = query[:t].view(t, self.num_heads, self.head_size)
        paged.attention(q, kv_cache, self.c8_k_scale, self.c8_v_scale, attn_metadata.query_start_loc,
                        attn_metadata.seq_lens, attn_metadata.block_table, self.scale, attn_metadata.causal,
                        impl=self.c8_impl, folded=self.c8_folded, out=output[:t],
                        sliding_window=self.sliding_window, softcap=self.logits_soft_cap)
        return output
