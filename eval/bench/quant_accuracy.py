"""How far each weight format moves a real model from fp32, on the same inputs.

    python -m ldqa.eval.bench.quant_accuracy [--models gemma3-270m,smollm2-135m] [--formats bf16,int8,int4]
                                             [--group-sizes 32,64,128] [--n 20] [--out out/quant-accuracy]

Per model and format (int4 at each group size), against fp32:
- teacher-forced next-token agreement (top-1 equal to fp32's), mean KL(fp32 || format) and the negative
  log-likelihood of the text, over the first 512 tokens of an essay of the shared haystack;
- greedy 32-token generations from `--n` NQ-open gold-passage prompts (seeded sample; passage + question
  + "Answer:"): how many are identical to fp32's, and the mean number of leading tokens that agree;
- the Block-Attention RoPE self-check's measured error (`BlockRuntime.check_error`).
Needs `../shared/data` (NQ-open and the essays). Writes `<out>/quant-accuracy.json` and a markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

import torch

from ldqa.attention.block_attention import BlockRuntime
from ldqa.attention.generate import SamplingConfig, start_generation
from ldqa.attention.loader import load_model
from ldqa.eval.bench.bench_runtime import write_report

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def _greedy(lm, ids, n=32):
    gen = start_generation(lm.model, ids, lm.tokenizer.decode, [], SamplingConfig(max_new_tokens=n))
    for _ in gen:
        pass
    return gen.token_ids


def _prompts(lm, n, seed=0):
    with gzip.open(DATA / "nq-open-oracle.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    random.Random(seed).shuffle(rows)
    out = []
    for r in rows[:n]:
        ctx = r["ctxs"][0]
        text = f"{ctx['title']}\n{ctx['text']}\n\nQuestion: {r['question']}?\nAnswer:"
        out.append([lm.tokenizer.bos_id] + lm.tokenizer.encode(text))
    return out


def measure(name: str, formats: list[tuple[str, int]], n: int) -> list[dict]:
    ref = load_model(name)
    essay = sorted((DATA / "pg-essays").glob("*.txt"))[0].read_text()
    ids = [ref.tokenizer.bos_id] + ref.tokenizer.encode(essay)[:511]
    target = torch.tensor(ids[1:])

    def logp(lm):
        lg = lm.model(torch.tensor([ids]), torch.arange(len(ids)), None, all_logits=True)[0]
        return torch.log_softmax(lg.float(), -1)

    p_ref = logp(ref)
    prompts = _prompts(ref, n)
    gen_ref = [_greedy(ref, p) for p in prompts]
    rows = []
    for fmt, gs in [("fp32", 64)] + formats:
        lm = load_model(name, weights=fmt, group_size=gs)
        p = logp(lm)
        gens = [_greedy(lm, q) for q in prompts] if fmt != "fp32" else gen_ref
        lead = []
        for a, b in zip(gens, gen_ref):
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            lead.append(k)
        rt = BlockRuntime(lm.model, lm.fingerprint)
        rt.self_check()
        rows.append({"model": name, "format": fmt, "group_size": gs if fmt == "int4" else None,
                     "top1_agreement": float((p.argmax(-1) == p_ref.argmax(-1)).float().mean()),
                     "kl": float((p_ref.exp() * (p_ref - p)).sum(-1).mean()),
                     "nll": float(-p[:-1].gather(1, target[:, None]).mean()),
                     "greedy_identical": sum(a == b for a, b in zip(gens, gen_ref)), "greedy_n": len(prompts),
                     "greedy_mean_leading_agree": sum(lead) / len(lead),
                     "self_check_ok": rt.enabled, "self_check_error": rt.check_error})
        print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | format | top-1 agree | KL | NLL | greedy 32 identical | leading tokens agreeing | "
             "self-check error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = r["format"] + (f" g{r['group_size']}" if r["group_size"] else "")
        lines.append(f"| {r['model']} | {fmt} | {r['top1_agreement']:.3f} | {r['kl']:.4f} | {r['nll']:.3f} | "
                     f"{r['greedy_identical']}/{r['greedy_n']} | {r['greedy_mean_leading_agree']:.1f} | "
                     f"{r['self_check_error']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ldqa.eval.bench.quant_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma3-270m,smollm2-135m")
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--group-sizes", default="32,64,128", help="int4 group sizes")
    ap.add_argument("--n", type=int, default=20, help="greedy generations per format")
    ap.add_argument("--out", default="out/quant-accuracy")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    formats = []
    for f in args.formats.split(","):
        formats += [(f, int(g)) for g in args.group_sizes.split(",")] if f == "int4" else [(f, 64)]
    rows = []
    for m in args.models.split(","):
        rows += measure(m, formats, args.n)
    write_report(Path(args.out), "quant-accuracy", rows, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
