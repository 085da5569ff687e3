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
