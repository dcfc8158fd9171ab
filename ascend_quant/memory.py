"""glibc malloc tuning for long calibration runs (no-ops on other C libraries).

The calibrator allocates thousands of temporaries of a few MB (GPTQ sweeps, observers)
and, per layer, activations of tens of MB, between long-lived blocks (each layer's int8
weights, the next layer's float weights). What glibc keeps of the freed memory is RSS;
what it gives back page-faults when reused. Measured (SmolLM2-135M, W8A8_DYNAMIC, 1 thread;
wall time / peak RSS):

    32 wiki paragraphs, whole model loaded (before layer streaming):
    glibc defaults (adaptive mmap threshold)                55 s / 1.83 GB
    128 KiB mmap threshold                                  83 s / 1.52 GB, 31 s of it in the kernel
    128 wiki paragraphs (13.6k tokens), streamed layers:
    256 MiB thresholds, no trim                             75 s / 2.01 GB
    32 MiB mmap / 64 MiB trim threshold, no trim            82 s / 1.77 GB
    the same, trim after every layer                        91 s / 1.42 GB
    the same, trim after every Linear group and layer       93 s / 1.20 GB   <- default

ASCEND_QUANT_MALLOC_TRIM=0 skips the trims (faster, more memory); MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ in the environment replace the thresholds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


@lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim        # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def tune_malloc() -> None:
    """Blocks of 32 MiB and more (activations) come from mmap and go back when freed;
    smaller ones are reused from the heap. MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_
    in the environment win."""
    libc = _libc()
    if libc is None or os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)


def trim() -> None:
    """Give free heap pages back to the system, also those between live blocks (glibc's
    malloc_trim releases every whole free page, not only the heap's top)."""
    libc = _libc()
    if libc is not None and os.environ.get("ASCEND_QUANT_MALLOC_TRIM", "1") != "0":
        libc.malloc_trim(0)
