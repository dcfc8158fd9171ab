"""Paged KV-cache kernels (int8 C8 pages): reference, batched torch and native CPU implementations."""

from ascend_quant.runtime.paged.c8 import (  # noqa: F401
    attention,
    attention_native,
    attention_reference,
    attention_torch,
    choose_impl,
    fold_scales,
    page_views,
    quantize_kv,
    write,
    write_native,
    write_reference,
)
