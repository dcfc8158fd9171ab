"""FLOAT: a tensor stored in the model's float dtype (unquantized Linears, norms, embeddings,
biases). With `--kv-cache int8` alone every Linear stays FLOAT."""

from __future__ import annotations

from ascend_quant.schemes.base import Scheme


class Float(Scheme):
    name = "FLOAT"
    cli_name = "float"
    # weights stay float: only the KV cache (with kv_cache set) is quantized
    preset = {"method": "minmax", "kv_cache": {}}


SCHEME = Float()
