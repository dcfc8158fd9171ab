"""Offline calibration: data, the runner, the group step, the job, observers, SmoothQuant, GPTQ, KV scales."""


class CalibrationError(Exception):
    """Calibration cannot go on (NaN activations, a shape the scheme cannot take, ...)."""
