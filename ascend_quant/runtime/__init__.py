"""Serving: reference / NPU / CPU kernels and the vLLM `ascend` quantization method."""
