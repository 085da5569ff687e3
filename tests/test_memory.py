"""attention/memory.py: glibc's malloc thresholds set once per process, and the opt-out."""

import ctypes
import subprocess
import sys

import pytest

GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

PROBE = """
import ctypes, ctypes.util, json, sys
from ldqa.attention import memory
first = memory.retain_freed_memory()
again = memory.retain_freed_memory()
# a 20 MB block (above glibc's default 128 KB mmap threshold, below 32 MB) comes from the heap, not from a
# fresh mmap; an mmapped chunk carries the IS_MMAPPED bit (2) in its size field, the word before the pointer
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
a = libc.malloc(20 << 20)
flags = ctypes.c_size_t.from_address(a - ctypes.sizeof(ctypes.c_size_t)).value & 2
libc.free(a)
print(json.dumps({"first": first, "again": again, "mmapped": bool(flags)}))
"""


def _probe(env_extra: dict) -> dict:
    import json
    import os

    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_large_frees_stay_in_the_heap():
    r = _probe({"LDQA_MALLOC": ""})
    assert r == {"first": True, "again": True, "mmapped": False}


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_opt_out_leaves_malloc_alone():
    # glibc's default: a 20 MB allocation is a fresh mmap each time
    r = _probe({"LDQA_MALLOC": "system"})
    assert r == {"first": False, "again": False, "mmapped": True}


# --------------------------------------------------------------------------- huge pages
def _anon_huge_kb() -> int:
    text = open("/proc/self/smaps_rollup").read()
    return int(text.split("AnonHugePages:")[1].split()[0])


def test_arena_copies_values_aligns_and_zeroes():
    import torch

    from ldqa.attention import memory

    a = torch.randn(3, 700_000)
    b = torch.arange(10, dtype=torch.int64)
    x, y, z = memory.arena([a, b, ((2, 5), torch.float16)])
    assert torch.equal(x, a) and torch.equal(y, b) and z.dtype == torch.float16 and not z.any()
    assert x.data_ptr() != a.data_ptr() and all(t.is_contiguous() for t in (x, y, z))
    assert (y.data_ptr() - x.data_ptr()) % memory.ALIGN == 0
    if memory.huge_pages_available():
        assert x.data_ptr() % memory.HUGE_PAGE == 0  # the block starts on a 2 MB page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_weights_move_to_huge_pages_and_stay_shared():
    import torch

    from ldqa.attention import memory

    if not memory.huge_pages_available():
        pytest.skip("transparent huge pages are off on this machine")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("big", torch.randn(1024, 1024))  # 4 MB
            self.register_buffer("small", torch.randn(8))

    m = torch.nn.Module()
    m.a, m.b = M(), M()
    m.b.big = m.a.big  # tied, as an embedding and its LM head
    before = {k: v.clone() for k, v in m.state_dict().items()}
    small = m.a.small
    huge_before = _anon_huge_kb()
    assert memory.weights_on_huge_pages(m) == 4 << 20
    assert m.a.big.data_ptr() == m.b.big.data_ptr() and m.a.big.data_ptr() % memory.HUGE_PAGE == 0
    assert m.a.small is small  # under 2 MB: left where it was
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert _anon_huge_kb() >= huge_before + 2048  # at least one 2 MB page backs it
    # the count moves while other threads allocate or khugepaged collapses pages: compare it with reads on
    # either side that agree with each other
    for _ in range(20):
        first, in_use, last = _anon_huge_kb(), memory.huge_pages_in_use(), _anon_huge_kb()
        if first == last:
            break
    assert first == last, "AnonHugePages kept changing between reads"
    assert in_use == first * 1024


def test_a_large_cpu_kv_cache_lives_in_one_block_and_behaves_as_a_small_one(monkeypatch):
    import torch

    from ldqa.attention import kv_cache
    from ldqa.attention.kv_cache import KVCache

    g = torch.Generator().manual_seed(0)
    steps = [(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)) for n in (5, 300, 1)]

    def fill(cache):
        for k, v in steps:
            start = cache.length
            for layer in range(3):
                cache.write(layer, k, v, torch.arange(start, start + k.shape[2]))
            cache.advance(k.shape[2])
        return cache

    big = fill(KVCache(3, 1, 2, 64, capacity=16))  # grows 16 -> 512: 3 x 2 x 512 x 64 x 4 B x 2 = 1.5 MB
    monkeypatch.setattr(kv_cache, "HUGE_CACHE_BYTES", 1 << 20)  # the same steps on the block path
    arena_cache = fill(KVCache(3, 1, 2, 64, capacity=16))
    ptrs = [t.data_ptr() for t in arena_cache._k + arena_cache._v]
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < 6 * arena_cache._k[0].numel() * 4 + 6 * 64  # one block
    clone = arena_cache.clone()
    for c in (arena_cache, clone):
        assert c.length == big.length and torch.equal(c.positions, big.positions)
        for layer in range(3):
            assert torch.equal(c.keys(layer), big.keys(layer)) and torch.equal(c.values(layer), big.values(layer))
    assert clone._k[0].data_ptr() != arena_cache._k[0].data_ptr()
