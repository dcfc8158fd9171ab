"""Offline calibration: data, the layer-by-layer pipeline, observers, SmoothQuant, GPTQ, KV scales."""


class CalibrationError(Exception):
    """Calibration cannot go on (NaN activations, a shape the scheme cannot take, ...)."""
