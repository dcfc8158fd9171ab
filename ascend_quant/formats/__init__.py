"""Checkpoint formats: the msModelSlim / vllm-ascend layout (read, write, verify, inspect)."""

from ascend_quant.formats.ascend import (Checkpoint, CheckpointError, Module, read_checkpoint,
                                         write_checkpoint)

__all__ = ["Checkpoint", "CheckpointError", "Module", "read_checkpoint", "write_checkpoint"]
