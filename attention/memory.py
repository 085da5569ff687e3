"""Memory for the CPU runtime: keep freed memory in the process, so that a prefill does not fault in its
working set page by page (`retain_freed_memory`); and put the weights and long KV caches on transparent
huge pages (`weights_on_huge_pages`, `arena`, `huge_page_bytes`; below).

Why the first: a prefill allocates and frees the same large buffers layer after layer: each projection's weight
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
import math
import mmap
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


# --------------------------------------------------------------------------- huge pages
HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
ALIGN = 64  # bytes: each tensor of an arena starts on a cache line


def huge_pages_available() -> bool:
    """Whether `huge_page_bytes` can ask for transparent huge pages: Linux with THP not "never", Python's
    mmap with MADV_HUGEPAGE, and LDQA_MALLOC not "system"."""
    if "huge" not in _state:
        ok = (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
              and os.environ.get("LDQA_MALLOC", "").strip().lower() != "system")
        if ok:
            try:
                with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                    ok = "[never]" not in f.read()
            except OSError:
                ok = False
        _state["huge"] = ok
    return _state["huge"]


def huge_pages_in_use() -> int:
    """Bytes of this process's memory on transparent huge pages (/proc/self/smaps_rollup's AnonHugePages;
    0 where it cannot be read): whether the advice took."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            text = f.read()
        return int(text.split("AnonHugePages:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return 0


def huge_page_bytes(n: int):
    """A uint8 tensor of `n` bytes in fresh, zeroed, anonymous memory whose 2 MB-aligned part is advised
    for transparent huge pages (madvise MADV_HUGEPAGE; the tensor starts on a 2 MB boundary), or
    `torch.zeros(n, dtype=torch.uint8)` where `huge_pages_available()` is False or `n` is under 2 MB.

    Why: a decode step streams every weight (1.1 GB for Qwen2.5 1.5B) and, at long contexts, the whole KV
    cache (0.4 GB at 8K tokens) through the caches; on 4 KB pages each of those pages costs a TLB miss and
    a page walk. On 2 MB pages, measured on a Zen 5 core: a step of the 1.5B model 34.3 -> 33.0 ms at 1,416
    tokens and 47.9 -> 45.4 ms at 8,192 (docs/results.md, "Decode on Qwen2.5-Coder-1.5B-Instruct"). The
    memory is returned to the system when the last tensor viewing it is freed."""
    import torch

    if n < HUGE_PAGE or not huge_pages_available():
        return torch.zeros(n, dtype=torch.uint8)
    mm = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    offset = -base % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, offset, n // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel that refuses the advice: 4 KB pages, the same memory
        pass
    return torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=offset)  # keeps `mm` alive


def arena(tensors: list) -> list:
    """Tensors laid out one after another (each on a 64-byte boundary) in one `huge_page_bytes` block:
    for each (shape, dtype) pair or tensor of `tensors`, a contiguous tensor of that shape and dtype in the
    block, holding a copy of the given tensor's values (zeros for a (shape, dtype) pair). One block for
    many tensors keeps the 2 MB rounding to once, not once per tensor."""
    import torch

    specs = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (tuple(t[0]), t[1]) for t in tensors]
    sizes = [math.prod(s) * d.itemsize for s, d in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    block = huge_page_bytes(max(total, 1))
    out = []
    for t, (shape, dtype), off, n in zip(tensors, specs, offsets, sizes):
        view = block[off:off + n].view(dtype).view(shape)
        if isinstance(t, torch.Tensor):
            view.copy_(t)
        out.append(view)
    return out


def weights_on_huge_pages(model) -> int:
    """Move every buffer of `model` (a torch module on the CPU) of at least 2 MB into one `arena`: the
    weight matrices, blocks and embeddings of ldqa's weight formats. A tensor shared by several modules (a
    tied embedding and LM head) stays shared. Returns the bytes moved (0 where huge pages are not
    available: nothing changes). Call before anything keeps pointers to the old buffers (the C runners)."""
    if not huge_pages_available():
        return 0
    big = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()
           if b is not None and b.device.type == "cpu" and b.numel() * b.element_size() >= HUGE_PAGE]
    unique = {}
    for _, _, b in big:
        unique.setdefault((b.data_ptr(), b.dtype, tuple(b.shape), tuple(b.stride())), b)
    moved = dict(zip(unique, arena([b.contiguous() for b in unique.values()])))
    for m, name, b in big:
        m._buffers[name] = moved[(b.data_ptr(), b.dtype, tuple(b.shape), tuple(b.stride()))]
    return sum(v.numel() * v.element_size() for v in moved.values())
