"""The GPU path in one command: the `gpu` tests, the kernels against torch SDPA, and ldqa's runtime end to
end on a random-weight model with Qwen2.5-1.5B's shapes, on one CUDA GPU (docs/gpu.md).

    python -m ldqa.eval.bench.gpu_check --out DIR         # a CUDA machine; about 4-6 minutes on an H200
    python -m ldqa.eval.bench.gpu_check --dry-run --out DIR  # no GPU: the end-to-end part on the CPU, tiny

Needs no packaged model and nothing from the network: the models are built from configs with random weights
(seeded) and a byte-level tokenizer made in code (`byte_tokenizer`), so only torch, triton, transformers,
tokenizers, safetensors and numpy must be there (plus pytest for the tests). Parts, each timed and written
to DIR even when a later part fails:

1. tests: ``pytest -m gpu`` over tests/test_gpu.py and tests/test_kernels.py (kernels against the torch
   reference per shape; greedy tokens on CUDA against the CPU's fp32 on the tiny models; every attention
   mode and debias method answering on CUDA; block reuse's RoPE self-check on the device);
2. kernels: `bench_kernels` (prefill and split-KV decode against SDPA's flash backend, block-sparse prefill,
   retrieval-style sparse decode, LSE merge, RoPE re-encoding), up to ``--max-seq`` tokens;
3. end to end (`end_to_end`), batch 1, bf16 weights and KV cache on CUDA: a prompt of NQ-open's layout
   (a prefix, 10 passages of ~130 tokens, a question: ~1.4K tokens), TTFT (prefill + first token) of full
   attention, block reuse with a cold store (every block encoded) and a warm one, and block+recompute
   (question@0.3) warm; decode tokens/s over 64 greedy tokens; and the last prompt token's logits on CUDA
   (bf16) against the CPU's fp32 on the same weights: max |difference| / max |logit| (stated tolerance
   `LOGIT_TOL`), cosine, and whether the top token agrees. --dry-run runs this part on the CPU with a
   3-layer model of the same vocabulary (bf16 against fp32 there), to check the script without a GPU.

Writes DIR/gpu_check.json (every number) and DIR/gpu_check.md (a table). Exit status 0 when every part ran
and every check passed, 1 otherwise, 2 without CUDA (unless --dry-run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Qwen2.5-Coder-1.5B-Instruct's shapes (its config.json), the model the CPU answers with by default
QWEN15_SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
TINY_SHAPE = dict(QWEN15_SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2)
# CUDA bf16 against CPU fp32, last prompt token's logits: max |diff| <= LOGIT_TOL * max |logit|. bf16 keeps
# 8 bits of mantissa (relative 2^-8 = 0.4% per rounding); activations, attention and the KV cache each round
LOGIT_TOL = 0.05
TARGETS = {"ttft_full_ms": 100.0, "ttft_block_warm_ms": 30.0, "decode_tokens_per_s": 150.0}


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges, made in code (no file, no download): ids 0-2 are
    <unk>, <s>, </s>, then one id per byte, so any text encodes and decodes back. Returns a
    transformers PreTrainedTokenizerFast (save it with `save_pretrained` next to a model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def random_model_dir(out: Path, shape: dict, seed: int = 0, device: str = "cpu") -> Path:
    """A Hugging Face directory at `out` (made once): a Qwen2 model of `shape` (a Qwen2Config's keyword
    arguments) with seeded random bf16 weights (built on `device`) and `byte_tokenizer`. Returns `out`."""
    import torch
    import transformers as T

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    cfg = T.Qwen2Config(**shape)
    with torch.device(device):
        model = T.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def nq_layout(vocab: int, n_passages: int = 10, passage_tokens: int = 130, seed: int = 0):
    """PromptSegments of NQ-open's multi-document layout with random token ids (3 <= id < vocab): a
    20-token prefix, `n_passages` headers of 4 tokens and bodies of `passage_tokens`, a 16-token question."""
    import random

    from ldqa.attention.segments import PromptSegments

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return PromptSegments(prefix=ids(20), headers=[ids(4) for _ in range(n_passages)],
                          passages=[ids(passage_tokens) for _ in range(n_passages)], question=ids(16))


def _timed(fn, sync, reps: int) -> tuple[float, object]:
    """Median wall time (ms) of `reps` calls of fn() (each followed by `sync()`), and the last result."""
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), out


def end_to_end(model_dir: Path, device: str, reps: int = 5, new_tokens: int = 64, compare_cpu: bool = True) -> dict:
    """The runtime's speed and accuracy on `device` for the model in `model_dir` (see the module
    docstring, part 3). Returns a dict of the measurements (times in ms)."""
    import torch

    from ldqa.attention.block_attention import BlockRuntime
    from ldqa.attention.context import exact_prefill
    from ldqa.attention.generate import SamplingConfig, continue_generation
    from ldqa.attention.loader import load_model
    from ldqa.indexes.kv_store import KVBlockStore

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    lm = load_model(str(model_dir), weights="bf16", kv_dtype="bf16", device=device)
    model = lm.model
    seg = nq_layout(model.cfg.vocab_size)
    chunks = list(range(len(seg.passages)))
    first = lambda ctx_logits: int(ctx_logits[0, -1].argmax())  # noqa: E731  (the first token: a sync)
    out = {"device": device, "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else "none",
           "prompt_tokens": len(seg), "layers": model.cfg.num_layers, "hidden": model.cfg.hidden_size}

    def full():
        ctx = exact_prefill(model, lm.fingerprint, seg, new_tokens)
        return ctx, first(ctx.logits)

    _timed(full, sync, 2)  # warm-up: kernel compilation, allocator
    out["ttft_full_ms"], (ctx, tok_full) = _timed(full, sync, reps)
    with tempfile.TemporaryDirectory() as store_dir:
        rt = BlockRuntime(model, lm.fingerprint, KVBlockStore(Path(store_dir), memory_budget_bytes=2 << 30))
        out["rope_self_check"] = bool(rt.self_check())
        out["rope_self_check_error"] = rt.check_error

        def block(mode):
            cache, logits, stats = rt.prefill(seg, chunks, mode=mode, recompute_ratio=0.3, select="question")
            return cache, logits, stats, first(logits)

        t0 = time.perf_counter()
        block("block")  # cold: every passage encoded and stored
        sync()
        out["ttft_block_cold_ms"] = (time.perf_counter() - t0) * 1000
        out["ttft_block_warm_ms"], (_, _, stats, _) = _timed(lambda: block("block"), sync, reps)
        out["block_warm_kv_hits"] = stats.kv_hits
        out["ttft_block_recompute_warm_ms"], _ = _timed(lambda: block("block+recompute"), sync, reps)
    gen = continue_generation(model, ctx.cache.clone(), ctx.logits, lambda ids: "", set(),
                              SamplingConfig(max_new_tokens=new_tokens), time.perf_counter())
    for _ in gen:  # (the decode_fn gives no text: nothing is yielded, every step runs)
        pass
    sync()
    out["decode_tokens_per_s"] = gen.stats.tokens_per_s
    out["decode_tokens"] = gen.stats.generated_tokens
    if compare_cpu:
        cpu = load_model(str(model_dir), weights="fp32", kv_dtype="fp32", device="cpu").model
        ref = exact_prefill(cpu, "cpu-fp32", seg, 1).logits[0, -1].float()
        got = ctx.logits[0, -1].float().cpu()
        out["logits_max_abs_diff"] = float((got - ref).abs().max())
        out["logits_max_abs"] = float(ref.abs().max())
        out["logits_rel_diff"] = out["logits_max_abs_diff"] / max(out["logits_max_abs"], 1e-9)
        out["logits_cosine"] = float(torch.nn.functional.cosine_similarity(got, ref, dim=0))
        out["top_token_agrees"] = int(got.argmax()) == int(ref.argmax())
        out["logits_within_tolerance"] = out["logits_rel_diff"] <= LOGIT_TOL
    return out


def _run_part(name: str, cmd: list[str], out_dir: Path, timeout: int, cwd: Path) -> dict:
    """Run one part as a child process in `cwd`; its output goes to out_dir/<name>.log. Returns rc and
    seconds. PYTHONSAFEPATH keeps the working directory off the child's import path: ldqa is the installed
    package (the repository's own `ldqa/` folder holds only its top-level module)."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")
    with open(out_dir / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": f"{name}.log"}


def _pytest_counts(log: Path) -> dict:
    """passed / skipped / failed / error counts from pytest's last summary line in `log`."""
    import re

    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1])} if lines else {}


def _markdown(result: dict) -> str:
    e = result.get("end_to_end", {})
    lines = ["# ldqa GPU check", "", f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}", "",
             "| part | status | seconds |", "|---|---|---|"]
    for name in ("tests", "kernels", "end_to_end_run"):
        p = result.get(name)
        if p:
            status = "ok" if p["rc"] == 0 else f"rc {p['rc']}"
            if p.get("counts"):
                status += " (" + ", ".join(f"{n} {k}" for k, n in p["counts"].items()) + ")"
            lines.append(f"| {name} | {status} | {p['seconds']} |")
        elif result.get("dry_run") and name != "end_to_end_run":
            lines.append(f"| {name} | not run (no CUDA) | |")
    if result.get("dry_run"):
        lines += ["", "Dry run on the CPU: the tests and kernels parts need CUDA and were not run; the end-to-end "
                      "numbers below come from a 3-layer model and are not comparable with the targets."]
    if e:
        lines += ["", f"End to end on {e['device']}, a Qwen2 model of {e['layers']} layers x {e['hidden']} hidden "
                      f"(random weights), bf16, {e['prompt_tokens']} prompt tokens, batch 1:", "",
                  "| measure | value | target |", "|---|---|---|"]
        for key, unit in (("ttft_full_ms", "ms"), ("ttft_block_cold_ms", "ms"), ("ttft_block_warm_ms", "ms"),
                          ("ttft_block_recompute_warm_ms", "ms"), ("decode_tokens_per_s", "tokens/s")):
            if key in e:
                target = TARGETS.get(key)
                bound = "" if target is None else (">= " if "per_s" in key else "< ") + f"{target:g}"
                bound = "n/a (dry run)" if bound and result.get("dry_run") else bound
                lines.append(f"| {key} | {e[key]:.1f} {unit} | {bound} |")
        if "logits_rel_diff" in e:
            lines.append(f"| logits vs CPU fp32, max diff / max logit | {e['logits_rel_diff']:.4f} "
                         f"(cosine {e['logits_cosine']:.5f}, top token {'same' if e['top_token_agrees'] else 'differs'}) "
                         f"| <= {LOGIT_TOL} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (gpu_check.json, gpu_check.md, logs)")
    ap.add_argument("--max-seq", type=int, default=131072, help="bench_kernels: longest sequence")
    ap.add_argument("--parts", default="tests,kernels,end_to_end", help="comma-separated parts to run")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: run the end-to-end part on the CPU with a tiny model (checks the script)")
    ap.add_argument("--repo", default=".", help="the ldqa repository whose tests/ the tests part runs (default: .)")
    args = ap.parse_args(argv)
    import torch

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device (a CPU-only build has none); run it on a "
              "GPU machine with a CUDA build of torch (or --dry-run here)", file=sys.stderr)
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    parts = set(args.parts.split(","))
    repo = Path(args.repo).resolve()
    if "tests" in parts and cuda and not (repo / "tests" / "test_gpu.py").is_file():
        print(f"gpu_check: {repo} has no tests/test_gpu.py: run it from the ldqa repository or pass --repo",
              file=sys.stderr)
        return 2
    result = {"gpu": torch.cuda.get_device_name(0) if cuda else "none (dry run)", "torch": torch.__version__,
              "triton": triton_version, "python": platform.python_version(), "dry_run": not cuda}
    ok = True

    def save():
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        (out_dir / "gpu_check.md").write_text(_markdown(result))

    if "tests" in parts and cuda:
        result["tests"] = _run_part("tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p",
                                              "no:cacheprovider", "tests/test_gpu.py", "tests/test_kernels.py"],
                                    out_dir, 240, repo)
        counts = result["tests"]["counts"] = _pytest_counts(out_dir / "tests.log")
        # a skipped gpu test (a missing module, no CUDA in the child) is a failure of the check
        ok &= result["tests"]["rc"] == 0 and counts.get("skipped", 0) == 0 and counts.get("passed", 0) > 0
        save()
    if "kernels" in parts and cuda:
        result["kernels"] = _run_part("kernels", [sys.executable, "-m", "ldqa.eval.bench.bench_kernels", "--out",
                                                  str(out_dir / "bench_kernels.json"), "--max-seq", str(args.max_seq)],
                                      out_dir, 300, repo)
        ok &= result["kernels"]["rc"] == 0
        save()
    if "end_to_end" in parts:
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                shape, device = (QWEN15_SHAPE, "cuda") if cuda else (TINY_SHAPE, "cpu")
                model_dir = random_model_dir(Path(tmp) / "model", shape, device=device)
                result["end_to_end"] = end_to_end(model_dir, device, reps=5 if cuda else 1,
                                                  new_tokens=64 if cuda else 4)
            e = result["end_to_end"]
            ok &= e["rope_self_check"] and e.get("logits_within_tolerance", True)
            result["end_to_end_run"] = {"rc": 0, "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as exc:  # noqa: BLE001  (recorded, the other parts' numbers are kept)
            import traceback

            (out_dir / "end_to_end.log").write_text(traceback.format_exc())
            result["end_to_end_run"] = {"rc": 1, "seconds": round(time.perf_counter() - t0, 1), "error": repr(exc),
                                        "log": "end_to_end.log"}
            ok = False
        save()
    save()
    print(_markdown(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
