"""Keep freed memory in the process, so that a prefill does not fault in its working set page by page.

Why: a prefill allocates and frees the same large buffers layer after layer: each projection's weight
dequantized to bf16 for its GEMM (27.5 MB for a 8,960 x 1,536 matrix), the chunked MLP's activations,
attention's q, k, v and output. glibc's malloc serves an allocation above its mmap threshold (128 KB,
raised on the fly to at most 32 MB) with a fresh mmap and returns it to the OS on free, and trims the
heap top above 2x that threshold; the next allocation of the same size then faults in every 4 KB page
again, zeroed by the kernel. Measured on Qwen2.5-Coder-1.5B-Instruct, 1,416 prompt tokens, 2 threads:
981,038 minor faults and 2.3 s of system time per prefill; with the settings below, none, and the prefill
7.9 s -> 6.1 s (docs/results.md, "Prefill and the allocator"). PyTorch's CPU tuning guide gives the same
advice in another form (preload jemalloc or tcmalloc); these two `mallopt` calls do it in-process.

What `retain_freed_memory` sets (glibc only; other C libraries are left alone):
- M_MMAP_THRESHOLD = 32 MB, glibc's largest: allocations up to it come from the heap, whose freed chunks
  are reused by the next allocation of the layer;
- M_TRIM_THRESHOLD = 2 GB (mallopt's largest, an int): the heap is shrunk only when 2 GB at its top are free.
The cost: the process keeps the peak of its heap (the largest prefill's working set, ~0.5 GB for the 1.5B
model at 1.4K tokens) instead of returning it between answers. Set LDQA_MALLOC=system to leave malloc's
defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # bytes; glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # bytes

_lock = threading.Lock()
_state: dict = {}


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring) once per process; called when a model is
    loaded. Returns True when they are set, False where they are not: LDQA_MALLOC=system, not Linux, not
    glibc, or mallopt refused. Raises nothing."""
    with _lock:
        if "set" not in _state:
            _state["set"] = _set()
        return _state["set"]


def _set() -> bool:
    if os.environ.get("LDQA_MALLOC", "").strip().lower() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        return libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):
        return False
