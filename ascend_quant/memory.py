"""glibc malloc tuning for long calibration runs (no-ops on other C libraries).

The calibrator allocates thousands of temporaries of a few MB (GPTQ sweeps, observers,
fake-quantized activations) between long-lived ones (each layer's int8 weights, the next
layer's float weights). glibc's defaults raise the mmap threshold as large blocks are
freed, so freed activations pile up in the heap; a small fixed threshold gives everything
back at once but page-faults every temporary. Measured on SmolLM2-135M, W8A8_DYNAMIC, 32
paragraphs, 1 thread, streamed layers (peak RSS / wall time): glibc defaults 1.83 GB / 55 s
(before streaming), 128 KiB threshold 1.14 GB / 83 s (31 s of it in the kernel), 32 MiB
threshold 1.45 GB / 55 s, 32 MiB plus `trim()` after every layer: see benchmarks/README.
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
    if libc is not None:
        libc.malloc_trim(0)
