"""Side-by-side timing of builds of the q8_0 CPU kernel (`kernels/q8_0.c`) in one process, interleaved.

    python -m ldqa.eval.bench.bench_q8_0_builds [--build old=git:main] [--build new=kernels/q8_0.c]
        [--build avx2=kernels/q8_0.c:-mno-avx512f] [--shapes 1x262144x640,layers] [--threads 1,2] [--reps 31]

Each `--build TAG=SOURCE[:FLAGS]` compiles SOURCE (a q8_0.c beside its decode_attention.c and simd.h, or
`git:REV` for the repository's kernels at a revision) with `cc -O3 -march=native -fopenmp` plus FLAGS
(space-separated, e.g. `-mno-avx512f` for the AVX2 loop, `-DPF_AHEAD=0` for no prefetch) into a temporary
directory. Shapes: `MxNxK` is `ldqa_q8_0_linear` on random Q8_0 weights, `q4_k:MxNxK` / `q6_k:MxNxK`
`ldqa_mats_linear` on random Q4_K / Q6_K blocks (matrices under 50 MB are cycled
through ~200 MB of copies, so they are read from memory as in a decode step); `layers` is 18 Gemma 3 270M
layers' fused decode calls (`ldqa_decode_attn_in` + `ldqa_decode_attn_out`, no attention; the weight-matrix
API of `gguf_blocks.h`: builds of revisions without it run the linear shapes only). Every repetition
runs every build once, in a shuffled order. Printed per build: median ms, min ms, the median over
repetitions of (build / first build) in the same repetition (paired: a machine's slow spells hit both),
the largest difference of its output from the first build's (relative to the output's largest value),
and the linear shapes' weight bytes per second.
For a machine shared with other work, compare the paired ratio and report the load (printed).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
KERNEL_FILES = ("q8_0.c", "decode_attention.c", "simd.h", "gguf_blocks.h")


def _sources(spec: str, tmp: Path, tag: str) -> Path:
    """The q8_0.c of `spec` (a path, or git:REV extracted into tmp)."""
    if not spec.startswith("git:"):
        return Path(spec).resolve()
    rev, out = spec[4:], tmp / f"src-{tag}"
    out.mkdir()
    for f in KERNEL_FILES:
        res = subprocess.run(["git", "show", f"{rev}:kernels/{f}"], cwd=ROOT, capture_output=True, text=True)
        if res.returncode == 0:  # a file missing at `rev` (gguf_blocks.h) is left out
            (out / f).write_text(res.stdout)
    return out / "q8_0.c"


def build(tag: str, spec: str, tmp: Path) -> ctypes.CDLL:
    if spec.startswith("git:"):
        rev, _, flags = spec[4:].partition(":")
        src = _sources("git:" + rev, tmp, tag)
    else:
        path, _, flags = spec.partition(":")
        src = _sources(path, tmp, tag)
    out = tmp / f"q8_0-{tag}.so"
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *flags.split(), "-o", str(out),
                    str(src), str(src.with_name("decode_attention.c")), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.ldqa_q8_0_linear.argtypes = [p, i64, i64, p, p, i64, p, i32]
    lib.ldqa_mats_linear.argtypes = [p, i32, p, i64, i64, p, i32]
    if hasattr(lib, "ldqa_decode_attn_in"):
        lib.ldqa_decode_attn_in.argtypes = [p, i64, p, f32, p, p, i64, i64, i64, p, p, p, p, p, i32]
        lib.ldqa_decode_attn_out.argtypes = [p, p, i64, i64, p, p, p, p, f32, p, i64, i32, p, p, i32]
    return lib


def _q8(rng, n: int, k: int):
    """random Q8_0 weights: qweight (n, k) int8, scales (n, k/32) float16"""
    return rng.integers(-127, 128, (n, k), dtype=np.int8), rng.uniform(1e-3, 2e-2, (n, k // 32)).astype(np.float16)


def linear_job(rng, libs, m: int, n: int, k: int):
    """one x (m, k) against ~200 MB of (n, k) weight copies; returns (name, run(tag, threads) -> calls, ys, bytes)"""
    copies = max(1, int(200e6 // (n * k))) if n * k < 50e6 else 1
    q, d = _q8(rng, n, k)
    ws = [(q.copy(), d.copy()) for _ in range(copies)]
    x = rng.standard_normal((m, k)).astype(np.float32)
    ys = {t: np.empty((m, n), np.float32) for t in libs}

    def run(tag, threads):
        for qw, sc in ws:
            libs[tag].ldqa_q8_0_linear(x.ctypes.data, m, k, qw.ctypes.data, sc.ctypes.data, n, ys[tag].ctypes.data,
                                       threads)
        return copies

    return f"M={m} N={n} K={k}", run, ys, n * k * 17 / 16


K_TYPES = {"q4_k": (12, 144, (0, 2)), "q6_k": (14, 210, (208,))}  # ggml type, bytes per 256, fp16 scale offsets


def ktype_job(rng, libs, kind: str, m: int, n: int, k: int):
    """one x (m, k) against ~200 MB of (n, k) weight copies in a K type (random blocks with sane fp16 scales),
    through `ldqa_mats_linear`; returns (name, run(tag, threads) -> calls, ys, bytes)"""
    from ldqa.kernels.cpu_linear import Mat

    ggml_type, block, scale_at = K_TYPES[kind]
    w = rng.integers(0, 256, (n, k // 256, block), dtype=np.uint8)
    for off in scale_at:
        w[:, :, off:off + 2] = rng.uniform(1e-3, 2e-2, (n, k // 256)).astype(np.float16)[..., None].view(np.uint8)
    w = w.reshape(n, -1)
    copies = max(1, int(200e6 // w.nbytes)) if w.nbytes < 50e6 else 1
    ws = [w.copy() for _ in range(copies)]
    mats = [(Mat * 1)(Mat(ggml_type, c.ctypes.data, None, n)) for c in ws]
    x = rng.standard_normal((m, k)).astype(np.float32)
    ys = {t: np.empty((m, n), np.float32) for t in libs}

    def run(tag, threads, keep=ws):  # the weights stay alive as long as `run`
        for mat in mats:
            libs[tag].ldqa_mats_linear(ctypes.addressof(mat), 1, x.ctypes.data, m, k, ys[tag].ctypes.data, threads)
        return copies

    return f"{kind} M={m} N={n} K={k}", run, ys, w.nbytes


def layers_job(rng, libs, n_layers=18, hid=640, heads=4, kv=1, hd=256, inter=2048):
    """Gemma 3 270M's fused decode calls over n_layers layers of random weights (one token)"""
    from ldqa.kernels.cpu_linear import Q8_0_TYPE, Mat

    def mats(*shapes):  # ldqa_mat array of random Q8_0 matrices (kept alive in `keep`)
        ws = [_q8(rng, n, k) for n, k in shapes]
        keep.append(ws)
        return (Mat * len(ws))(*(Mat(Q8_0_TYPE, q.ctypes.data, d.ctypes.data, q.shape[0]) for q, d in ws))

    keep, nq = [], (heads + 2 * kv) * hd
    lay = [(mats((heads * hd, hid), (kv * hd, hid), (kv * hd, hid)), mats((hid, heads * hd)),
            mats((inter, hid), (inter, hid)), mats((hid, inter))) for _ in range(n_layers)]
    norm = [rng.uniform(0.5, 1.5, hid).astype(np.float32) for _ in range(3)]
    hnorm = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    cos, sin = np.cos(np.arange(hd) * 0.1).astype(np.float32), np.sin(np.arange(hd) * 0.1).astype(np.float32)
    x0 = rng.standard_normal(hid).astype(np.float32)
    attn = (rng.standard_normal(heads * hd) * 0.1).astype(np.float32)
    qkv = np.empty(nq, np.float32)
    ys = {t: np.empty(hid, np.float32) for t in libs}
    a = lambda arr: arr.ctypes.data  # noqa: E731

    def run(tag, threads):
        lib, x, xo = libs[tag], x0.copy(), np.empty_like(x0)
        for wqkv, wo, wgu, wd in lay:
            lib.ldqa_decode_attn_in(a(x), hid, a(norm[0]), 1e-6, ctypes.addressof(wqkv), None, heads, kv, hd,
                                    a(hnorm), a(hnorm), a(cos), a(sin), a(qkv), threads)
            lib.ldqa_decode_attn_out(a(x), a(attn), hid, heads * hd, ctypes.addressof(wo), a(norm[1]), a(norm[2]),
                                     a(norm[0]), 1e-6, ctypes.addressof(wgu), inter, 1, ctypes.addressof(wd), a(xo),
                                     threads)
            x, xo = xo, x
        ys[tag][:] = x
        return 1

    return f"{n_layers} Gemma 3 270M layers (attn_in + attn_out)", run, ys, None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="append", help="TAG=SOURCE[:FLAGS]; the first is the reference")
    ap.add_argument("--shapes", default="1x262144x640,layers,1x4096x640,1x640x2048,17x4096x640")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=31)
    args = ap.parse_args(argv)
    builds = args.build or ["old=git:main", "new=kernels/q8_0.c"]
    rng, order = np.random.default_rng(0), random.Random(1)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for spec in builds:
            tag, _, src = spec.partition("=")
            libs[tag] = build(tag, src, Path(tmp))
        print("load average:", os.getloadavg(), flush=True)
        for shape in args.shapes.split(","):
            kind, _, dims = shape.rpartition(":")
            name, run, ys, nbytes = (layers_job(rng, libs) if shape == "layers"
                                     else ktype_job(rng, libs, kind, *map(int, dims.split("x"))) if kind
                                     else linear_job(rng, libs, *map(int, dims.split("x"))))
            for threads in map(int, args.threads.split(",")):
                times = {t: [] for t in libs}
                for _ in range(args.reps):
                    tags = list(libs)
                    order.shuffle(tags)
                    for tag in tags:
                        t0 = time.perf_counter()
                        calls = run(tag, threads)
                        times[tag].append((time.perf_counter() - t0) / calls * 1e3)
                ref = builds[0].partition("=")[0]
                line = f"{name} threads={threads}:"
                for tag, ts in times.items():
                    ratio = float(np.median(np.array(ts) / np.array(times[ref])))
                    diff = float(np.abs(ys[tag] - ys[ref]).max() / (np.abs(ys[ref]).max() + 1e-30))
                    gbs = f", {nbytes / np.median(ts) / 1e6:.1f} GB/s" if nbytes else ""
                    line += f" | {tag} {np.median(ts):.3f} ms (min {min(ts):.3f}{gbs}) x{ratio:.3f} diff {diff:.0e}"
                print(line, flush=True)
        print("load average:", os.getloadavg())


if __name__ == "__main__":
    main()
