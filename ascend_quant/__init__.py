"""ascend-quant: quantize Hugging Face causal LMs for Huawei Ascend NPUs and serve them in vLLM."""

__version__ = "0.1.0"
