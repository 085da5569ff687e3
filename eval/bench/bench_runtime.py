"""ldqa's runtime in every weight format against llama.cpp, side by side in one process.

    python -m ldqa.eval.bench.bench_runtime [--formats fp32,bf16,int8,int4,q8_0] [--threads 1,2] [--lengths 1416,8192]
                                            [--new-tokens 32] [--repeats 3] [--out out/bench-runtime] [--no-llama]
                                            [--shape-check]

The same GGUF (Gemma 3 270M Q4_K_M by default) and the same prompt ids go to ldqa (each `--formats`
entry, loaded through `load_model`) and to llama.cpp (llama-cpp-python, the optional `bench` extra; skipped
with a note when it is not installed). Runs are interleaved: for each repeat, thread count and prompt
length every engine runs once, so a busy machine slows them all alike; the table gives medians.

Per engine: TTFT (the prompt's prefill, ms), decode tokens/s (greedy, `--new-tokens`), the weights'
resident size (bytes of the model's tensors; llama.cpp: the GGUF's tensor bytes) and the RSS growth when
the model was loaded, bytes read per decoded token (the matrices a decode step multiplies with: every
linear layer and the LM head, plus the keys and values its attention needs, `kv_read_bytes`: a sliding
layer's window, not its whole cache, in the cache's dtype, llama.cpp's f16; not the embedding table, of
which a step reads one row)
against the machine's read bandwidth measured here (a sum over a 1 GiB tensor at the same thread count):
bytes/token x tokens/s is the achieved bandwidth, and the bandwidth / bytes per token is the decode rate
no implementation can pass. Ratios against llama.cpp and against ldqa fp32 are printed and written with
everything else to `<out>/bench-runtime.json`.

The prompt: the bundled sample's documents (repeated to reach the length) with a question about the fan
hub bolts, BOS first; the same ids for every engine. Greedy texts are compared across engines: "same
tokens" counts the greedy tokens equal to the first engine's (the first `--formats` entry; fp32 by
default), position by position.

`--shape-check`: a random-weight model with Llama-3.2-1B's shapes (1.24B parameters) is built in int8,
int4 and q8_0, tensor by tensor (never whole in fp32), and decodes a few tokens; its resident size is reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ldqa.attention.decode_runner import TorchLayers
from ldqa.attention.loader import load_model
from ldqa.attention.model_sources import resolve_gguf
from ldqa.attention.quant import QLinear, model_nbytes

QUESTION = "\n\nQuestion: What torque should the fan hub bolts be tightened to?\nAnswer:"


def _rss() -> int:
    """Resident set size of this process (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def prompt_ids(tokenizer, length: int) -> list[int]:
    """BOS + the bundled sample's documents (as loaded by ldqa, repeated as needed) cut so that the
    question fits, + the question: `length` ids in all."""
    from ldqa.retrieval.loaders import load_document

    docs = Path(__file__).resolve().parents[2] / "app" / "sample" / "docs"
    text = "\n\n".join(load_document(p).text for p in sorted(docs.iterdir()))
    body = tokenizer.encode(text)
    q = tokenizer.encode(QUESTION)
    need = length - 1 - len(q)
    body = (body * (need // len(body) + 1))[:need]
    return [tokenizer.bos_id] + body + q


def read_bandwidth(threads: int, gib: float = 1.0) -> float:
    """Bytes/s of reading a `gib` GiB fp32 tensor (torch.sum) at `threads` threads, best of 5."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def decode_bytes(model) -> int:
    """Bytes of the tensors one decode step reads: every linear layer (incl. the LM head) and the norms."""
    total = 0
    for m in model.modules():
        if isinstance(m, QLinear) or m.__class__.__name__ == "RMSNorm":
            total += sum(b.numel() * b.element_size() for b in list(m.buffers(recurse=False))
                         + list(m.parameters(recurse=False)))  # (the weights share one huge-page block)
    return total


def kv_read_bytes(cfg, n: int, elem_bytes: int) -> int:
    """Bytes of keys and values one decode step's attention needs over an `n`-token context: per layer
    2 (K and V) x its span (min(n, `cfg.sliding_window`) for a "sliding" layer, n for a "full" one)
    x num_kv_heads x head_dim x `elem_bytes` (4: fp32 cache, 2: bf16 or f16). A lower bound on what an
    engine reads (one that reads a sliding layer's whole cache reads more)."""
    types = cfg.layer_types or ["full"] * cfg.num_layers
    span = sum(min(n, cfg.sliding_window) if t == "sliding" and cfg.sliding_window else n for t in types)
    return 2 * span * cfg.num_kv_heads * cfg.head_dim * elem_bytes


# --------------------------------------------------------------------------- engines
class LdqaEngine:
    """ldqa in one weight format. `spec` is a format name, or "q8_0/modules": q8_0 weights decoded without
    the fused decode: every layer through its torch modules and
    attention through the torch reference (for a side-by-side of the two paths on the same weights)."""

    def __init__(self, name: str, spec: str, group_size: int):
        weights, _, variant = spec.partition("/")
        if variant not in ("", "modules") or (variant and weights != "q8_0"):
            raise ValueError(f"--formats entry {spec!r}: a weight format, or q8_0/modules")
        self.modules = variant == "modules"
        rss0 = _rss()
        self.lm = load_model(name, weights=weights, group_size=group_size)
        self.label = f"ldqa {spec}" + (f" g{group_size}" if weights == "int4" else "")
        self.rss_growth = _rss() - rss0
        self.resident = model_nbytes(self.lm.model)
        self.step_bytes = decode_bytes(self.lm.model)
        self.cfg = self.lm.model.cfg
        self.kv_elem_bytes = self.lm.model.kv_dtype.itemsize

    def run(self, ids: list[int], new_tokens: int) -> dict:
        if not self.modules:
            return self._run(ids, new_tokens)
        runner, self.lm.model.decoder = self.lm.model.decoder, TorchLayers()
        before = os.environ.get("LDQA_KERNELS")
        os.environ["LDQA_KERNELS"] = "torch"
        try:
            return self._run(ids, new_tokens)
        finally:
            if before is None:
                del os.environ["LDQA_KERNELS"]
            else:
                os.environ["LDQA_KERNELS"] = before
            self.lm.model.decoder = runner

    @torch.inference_mode()
    def _run(self, ids: list[int], new_tokens: int) -> dict:
        model = self.lm.model
        cache = model.new_cache(capacity=len(ids) + new_tokens + 8)
        t0 = time.perf_counter()
        logits = model(torch.tensor([ids]), torch.arange(len(ids)), cache)
        tok = int(logits[0, -1].argmax())
        ttft = time.perf_counter() - t0
        out = [tok]
        t1 = time.perf_counter()
        for i in range(new_tokens - 1):
            logits = model(torch.tensor([[tok]]), torch.tensor([len(ids) + i]), cache)
            tok = int(logits[0, -1].argmax())
            out.append(tok)
        dec = time.perf_counter() - t1
        from ldqa.attention.memory import huge_pages_in_use

        return {"ttft_ms": ttft * 1000, "decode_tok_s": (new_tokens - 1) / dec, "tokens": out,
                "huge_page_mb": huge_pages_in_use() >> 20}  # the weights' and the cache's, while decoding


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python on the same GGUF; one context per thread count."""

    kv_elem_bytes = 2  # llama.cpp's default K/V cache type, f16

    def __init__(self, gguf: Path, n_ctx: int, cfg):
        import numpy as np
        from llama_cpp import Llama

        self.np, self.gguf, self.n_ctx, self._ctx, self.cfg = np, gguf, n_ctx, {}, cfg
        self.label = "llama.cpp"
        rss0 = _rss()
        self._get(1)
        self.rss_growth = _rss() - rss0
        from gguf import GGUFReader

        tensors = GGUFReader(str(gguf)).tensors
        self.resident = sum(int(t.n_bytes) for t in tensors)
        emb = [t for t in tensors if t.name == "token_embd.weight"]
        tied = not any(t.name == "output.weight" for t in tensors)
        self.step_bytes = self.resident - (0 if tied else sum(int(t.n_bytes) for t in emb))

    def _get(self, threads: int):
        from llama_cpp import Llama

        if threads not in self._ctx:
            self._ctx[threads] = Llama(str(self.gguf), n_ctx=self.n_ctx, n_threads=threads, n_threads_batch=threads,
                                       n_batch=512, verbose=False)
        return self._ctx[threads]

    def run(self, ids: list[int], new_tokens: int, threads: int) -> dict:
        llm = self._get(threads)
        llm.reset()
        n_vocab = llm.n_vocab()

        def argmax():
            return int(self.np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).argmax())

        t0 = time.perf_counter()
        llm.eval(ids)
        tok = argmax()
        ttft = time.perf_counter() - t0
        out = [tok]
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([tok])
            tok = argmax()
            out.append(tok)
        dec = time.perf_counter() - t1
        return {"ttft_ms": ttft * 1000, "decode_tok_s": (new_tokens - 1) / dec, "tokens": out}


# --------------------------------------------------------------------------- shape check
def shape_check(fmt: str, new_tokens: int = 8) -> dict:
    """A random-weight model with Llama-3.2-1B's shapes in `fmt`, built one tensor at a time: its
    resident bytes, peak RSS growth while building, decode tokens/s."""
    from ldqa.attention.config import ModelConfig
    from ldqa.attention.loader import _build_model
    from ldqa.attention.weight_cache import quantize_rows

    cfg = ModelConfig(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                      num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    from ldqa.attention.model import Transformer

    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Transformer(cfg).state_dict().items() if n != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    rss0, peak = _rss(), 0
    groups = {}
    for name, shape in shapes.items():
        def rows(shape=shape):
            if len(shape) == 1:
                yield torch.ones(shape)
                return
            for i in range(0, shape[0], 1 << 14):
                yield torch.randn(min(1 << 14, shape[0] - i), shape[1], generator=gen) * 0.02
        groups[name] = quantize_rows(rows, fmt, 64, name)
        peak = max(peak, _rss() - rss0)
    model = _build_model(cfg, groups, Path("<random>"))
    del groups
    gc.collect()
    n_params = sum(int(torch.tensor(s).prod()) for s in shapes.values())
    cache = model.new_cache(capacity=64)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]), torch.arange(4), cache)
        t0 = time.perf_counter()
        for i in range(new_tokens):
            model(torch.tensor([[5]]), torch.tensor([4 + i]), cache)
        tps = new_tokens / (time.perf_counter() - t0)
    return {"format": fmt, "parameters": n_params, "resident_bytes": model_nbytes(model),
            "fp32_bytes": n_params * 4, "peak_rss_growth_while_building": peak, "decode_tok_s": tps}


# --------------------------------------------------------------------------- main
def run(args) -> dict:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    threads = [int(t) for t in args.threads.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    engines = []
    for fmt in formats:
        engines.append(LdqaEngine(args.model, fmt, args.group_size))
        gc.collect()
    tok = engines[0].lm.tokenizer
    note = ""
    if not args.no_llama:
        try:
            engines.append(LlamaCppEngine(resolve_gguf(args.model) if not args.model.endswith(".gguf")
                                          else Path(args.model), max(lengths) + args.new_tokens + 16,
                                          engines[0].cfg))
        except ImportError:
            note = "llama-cpp-python is not installed (pip install -e '.[bench]'): llama.cpp skipped"
            print(note)
    bw = {t: read_bandwidth(t) for t in threads}
    runs = []
    for rep in range(args.repeats):
        for n in lengths:
            ids = prompt_ids(tok, n)
            for t in threads:
                torch.set_num_threads(t)
                for e in engines:
                    r = e.run(ids, args.new_tokens, t) if isinstance(e, LlamaCppEngine) else e.run(ids, args.new_tokens)
                    runs.append({"engine": e.label, "threads": t, "prompt_tokens": n, "repeat": rep, **r})
                    print(f"rep {rep} n={n} t={t} {e.label}: TTFT {r['ttft_ms']:.0f} ms, "
                          f"decode {r['decode_tok_s']:.1f} tok/s"
                          + (f", {r['huge_page_mb']} MB on huge pages" if "huge_page_mb" in r else ""), flush=True)
    rows = []
    for n in lengths:
        for t in threads:
            ref_text = None
            for e in engines:
                rs = [r for r in runs if r["engine"] == e.label and r["threads"] == t and r["prompt_tokens"] == n]
                ttft = statistics.median(r["ttft_ms"] for r in rs)
                tps = statistics.median(r["decode_tok_s"] for r in rs)
                step = e.step_bytes + kv_read_bytes(e.cfg, n, e.kv_elem_bytes)
                row = {"engine": e.label, "threads": t, "prompt_tokens": n, "ttft_ms": ttft, "decode_tok_s": tps,
                       "resident_bytes": e.resident, "rss_growth_bytes": e.rss_growth,
                       "bytes_per_token": step, "achieved_gb_s": step * tps / 1e9,
                       "bandwidth_gb_s": bw[t] / 1e9, "bandwidth_limit_tok_s": bw[t] / step,
                       "tokens": rs[0]["tokens"]}
                if ref_text is None:
                    ref_text = rs[0]["tokens"]
                row["same_tokens_as_first"] = sum(a == b for a, b in zip(rs[0]["tokens"], ref_text))
                rows.append(row)
    for row in rows:
        peers = {r["engine"]: r for r in rows if r["threads"] == row["threads"] and r["prompt_tokens"] == row["prompt_tokens"]}
        for ref in ("llama.cpp", "ldqa fp32"):
            if ref in peers:
                row[f"decode_vs_{ref}"] = row["decode_tok_s"] / peers[ref]["decode_tok_s"]
                row[f"prefill_vs_{ref}"] = peers[ref]["ttft_ms"] / row["ttft_ms"]
    result = {"model": args.model, "new_tokens": args.new_tokens, "repeats": args.repeats, "note": note,
              "torch": torch.__version__, "rows": rows}
    if args.shape_check:
        result["shape_check"] = []
        for fmt in ("int8", "int4", "q8_0"):
            torch.set_num_threads(max(threads))
            result["shape_check"].append(shape_check(fmt))
            print("shape check", result["shape_check"][-1], flush=True)
            gc.collect()
    return result


def table(result: dict) -> str:
    """The result as a markdown table (one row per engine, thread count and prompt length)."""
    lines = ["| prompt | threads | engine | TTFT ms | decode tok/s | decode vs llama.cpp | decode vs fp32 | "
             "prefill vs llama.cpp | weights MB | bytes/token MB | achieved GB/s | limit tok/s | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        f = lambda k: f"{r[k]:.2f}x" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['prompt_tokens']} | {r['threads']} | {r['engine']} | {r['ttft_ms']:.0f} | "
                     f"{r['decode_tok_s']:.1f} | {f('decode_vs_llama.cpp')} | {f('decode_vs_ldqa fp32')} | "
                     f"{f('prefill_vs_llama.cpp')} | {r['resident_bytes'] / 1e6:.0f} | {r['bytes_per_token'] / 1e6:.0f} | "
                     f"{r['achieved_gb_s']:.1f} (of {r['bandwidth_gb_s']:.1f}) | {r['bandwidth_limit_tok_s']:.0f} | "
                     f"{r['same_tokens_as_first']}/{len(r['tokens'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ldqa.eval.bench.bench_runtime", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="a packaged model name or a .gguf file")
    ap.add_argument("--formats", default="fp32,bf16,int8,int4,q8_0",
                    help="ldqa weight formats, comma-separated (q8_0/modules: q8_0 without the fused decode and "
                         "the C decode attention); the first is the reference of 'same tokens'")
    ap.add_argument("--group-size", type=int, default=64, help="int4 group size")
    ap.add_argument("--threads", default="1,2", help="torch / llama.cpp thread counts, comma-separated")
    ap.add_argument("--lengths", default="1416,8192", help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens decoded per run")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the table gives medians")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument("--shape-check", action="store_true", help="also build a Llama-3.2-1B-shaped model in int8/int4/q8_0")
    ap.add_argument("--out", default="out/bench-runtime")
    args = ap.parse_args(argv)
    result = run(args)
    write_report(Path(args.out), "bench-runtime", result, table(result))
    return 0


def write_report(out: Path, stem: str, data, md: str) -> None:
    """Write `<out>/<stem>.json` (data) and `<out>/<stem>.md` (md), and print md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    raise SystemExit(main())
