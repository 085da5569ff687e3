"""The CPU kernels in C as one library (`q8_0.c` with `gguf_blocks.h`, `decode_attention.c`, `int8_rows.c`):
built at first use with the machine's C compiler (`cc -O3 -march=native -fopenmp`) into
`$LDQA_CACHE_DIR/kernels/` (or the user cache), keyed by the sources, the compiler and the CPU flags, through
a temporary file renamed into place; loaded with ctypes (the GIL is released during a call). Needs x86-64
with AVX2, FMA and F16C. Where it cannot be built (no compiler, another CPU), `available()` is False with the reason in
`unavailable_reason()`, and the callers (`cpu_linear`) compute with the torch references (correct, slow).
`LDQA_CPU_KERNELS=torch` forces the references (read once per process; `reset()` re-reads it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(n) for n in ("q8_0.c", "decode_attention.c", "int8_rows.c"))  # one library
_HEADERS = (Path(__file__).with_name("simd.h"), Path(__file__).with_name("gguf_blocks.h"))  # included by the sources (part of the build key)
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
_lock = threading.Lock()
_state: dict = {}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    env = os.environ.get("LDQA_CACHE_DIR")
    if env:
        return Path(env) / "kernels"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ldqa")) / "kernels"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build() -> ctypes.CDLL:
    """Compile (once per source, compiler and CPU) and load the kernel. Raises RuntimeError saying why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the q8_0 CPU kernel is written for x86-64 (this machine: {platform.machine()})")
    flags = _cpu_flags()
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in flags]
    if missing:
        raise RuntimeError(f"the q8_0 CPU kernel needs the CPU features {', '.join(missing)}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang; or set CC) to build the q8_0 CPU kernel")
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]  # (+ "-lm" after the source)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([*(src.read_text() for src in _SOURCES + _HEADERS), " ".join(cmd), version,
                                    " ".join(sorted(flags))]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"q8_0-{key}.so"
    if target.exists():
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as e:  # a damaged file (disk full, someone's copy): build it again
            log.warning("cached q8_0 kernel %s cannot be loaded (%s); rebuilding it", target, e)
            lib = ctypes.CDLL(str(_compile(cmd, target)))
    else:
        lib = ctypes.CDLL(str(_compile(cmd, target)))
    lib.ldqa_q8_0_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.ldqa_q8_0_linear.restype = ctypes.c_int
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.ldqa_mats_linear.argtypes = [p, i32, p, i64, i64, p, i32]
    lib.ldqa_mats_linear.restype = ctypes.c_int
    lib.ldqa_gguf_dequantize.argtypes = [i64, p, i64, i64, p, i32]
    lib.ldqa_gguf_dequantize.restype = ctypes.c_int
    lib.ldqa_dequantize_bf16.argtypes = [i64, p, p, i64, i64, p, i32]
    lib.ldqa_dequantize_bf16.restype = ctypes.c_int
    lib.ldqa_decode_attn_in.argtypes = [p, i64, p, f32, p, p, i64, i64, i64, p, p, p, p, p, i32]
    lib.ldqa_decode_attn_in.restype = ctypes.c_int
    lib.ldqa_decode_attn_out.argtypes = [p, p, i64, i64, p, p, p, p, f32, p, i64, i32, p, p, i32]
    lib.ldqa_decode_attn_out.restype = ctypes.c_int
    lib.ldqa_decode_attention.argtypes = [p, p, p, i64, i64, i64, i64, i64, p, f32, p, i32]
    lib.ldqa_decode_attention.restype = ctypes.c_int
    lib.ldqa_decode_attention_biased.argtypes = [p, p, p, i64, i64, i64, i64, i64, p, p, f32, p, i32]
    lib.ldqa_decode_attention_biased.restype = ctypes.c_int
    lib.ldqa_decode_stack.argtypes = [p, i64, p, i64, i64, i64, i64, f32, i64, i64, f32, i32]
    lib.ldqa_decode_stack.restype = ctypes.c_int
    lib.ldqa_quantize_rows_int8.argtypes = [p, i64, i64, p, p, i32]
    lib.ldqa_quantize_rows_int8.restype = ctypes.c_int
    lib.ldqa_dequantize_int32.argtypes = [p, i64, i64, p, p, p, i32]
    lib.ldqa_dequantize_int32.restype = ctypes.c_int
    lib.ldqa_quantize_weight_rows_int8.argtypes = [p, i64, i64, p, p, i32]
    lib.ldqa_quantize_weight_rows_int8.restype = ctypes.c_int
    lib.ldqa_argmax.argtypes = [p, i64]
    lib.ldqa_argmax.restype = i64
    return lib


def _compile(cmd: list[str], target: Path) -> Path:
    """Compile q8_0.c to `target` through a temporary file renamed into place (a crash never leaves a
    half-written library under the final name). Raises RuntimeError with the compiler's message."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        res = subprocess.run(cmd + ["-o", str(out), *map(str, _SOURCES), "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building the q8_0 CPU kernel failed ({' '.join(cmd)}): {res.stderr.strip()[:500]}")
        os.replace(out, target)
    log.info("built the q8_0 CPU kernel: %s", target)
    return target


def _lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (reference) — decided once per process (see `reset`)."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            if os.environ.get("LDQA_CPU_KERNELS", "").strip().lower() == "torch":
                _state["lib"], _state["why"] = None, "LDQA_CPU_KERNELS=torch"
            else:
                try:
                    _state["lib"], _state["why"] = _build(), None
                except (RuntimeError, OSError) as e:
                    _state["lib"], _state["why"] = None, str(e)
                    log.warning("%s; q8_0 weights use the torch reference (slow): use weights='int8' for speed", e)
    return _state["lib"]


def reset() -> None:
    """Forget the build decision, so the next call re-reads LDQA_CPU_KERNELS and rebuilds (tests)."""
    with _lock:
        _state.clear()


def available() -> bool:
    """Whether the C kernel is built and loaded (compiling it on the first call, ~1 s).
    LDQA_CPU_KERNELS=torch (read once per process) makes it False."""
    return _lib() is not None


def unavailable_reason() -> str | None:
    """Why the kernel is not available; None when it is."""
    _lib()
    return _state.get("why")
