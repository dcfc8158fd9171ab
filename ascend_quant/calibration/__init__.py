"""Offline calibration: data, the layer-by-layer pipeline, observers, SmoothQuant, GPTQ, KV scales."""
