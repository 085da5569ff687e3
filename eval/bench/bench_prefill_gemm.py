"""The prefill GEMM in int8 against bf16 ($LDQA_PREFILL_GEMM, `quant.QLinear.prefill_gemm`), side by side in
one process on one loaded model: first-token time of full attention, and how close each GEMM's next-token
distributions come to the exact fp32 model's.

    OMP_NUM_THREADS=2 python -m ldqa.eval.bench.bench_prefill_gemm --model qwen2.5-coder-1.5b-instruct \
        [--n 12] [--passages 10] [--new-tokens 8] [--reference fp32|none] [--out out/bench-prefill-gemm]

NQ-open multi-doc prompts (the first --n seeded questions, gold passage at 1, 5 and 10 in turn; the
chat template the API uses). Each prompt is prefilled with full attention under each GEMM, the order
alternating between questions, each GEMM's weights made before timing; the first then decodes
--new-tokens tokens greedily and the other (and the fp32 reference model, `weights="fp32"`: every GEMM in
fp32 over the same dequantized GGUF bytes) is teacher-forced on them, decode steps being the same C
kernels under both GEMMs. Reports the median prefill seconds, bf16 / int8, the mean KL(reference ||
GEMM) in nats (SE over prompts) and the top-1 agreement with the reference, per GEMM; the KL of int8 to
bf16 too. Writes OUT/prefill-gemm.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example

GEMMS = ("bf16", "int8")


def first_logprobs(model, ids: list[int], forced: list[int] | None, m: int):
    """Prefill `ids` (full attention) then decode m - 1 tokens: greedily when `forced` is None, else
    teacher-forced on `forced`. -> ((m, vocab) log-probabilities, the greedy tokens, prefill seconds)."""
    import torch

    with torch.no_grad():
        cache = model.new_cache(capacity=len(ids) + m + 8)
        t0 = time.perf_counter()
        logits = model(torch.tensor([ids]), torch.arange(len(ids)), cache)
        seconds = time.perf_counter() - t0
        outs, ys = [logits[0, -1]], []
        for j in range(m - 1):
            ys.append(int(logits[0, -1].argmax()) if forced is None else forced[j])
            logits = model(torch.tensor([[ys[-1]]]), torch.tensor([cache.length]), cache)
            outs.append(logits[0, -1])
        return torch.log_softmax(torch.stack(outs).float(), -1), ys, seconds


def summary(rows: list[tuple[float, float]]) -> dict:
    kls = [r[0] for r in rows]
    return {"kl": statistics.fmean(kls), "kl_se": statistics.stdev(kls) / len(kls) ** 0.5 if len(kls) > 1 else 0.0,
            "top1_agreement": statistics.fmean(r[1] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=12, help="prompts (the first of the seeded order)")
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=8, help="next-token distributions compared per prompt")
    ap.add_argument("--reference", choices=("fp32", "none"), default="fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("out/bench-prefill-gemm"))
    args = ap.parse_args(argv)
    if not args.data.exists():
        raise SystemExit(f"--data {args.data}: not found (the NQ-open oracle file of ../shared/data)")

    records = load_nq(args.data)
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from ldqa.app.api import LongDocQA, Passage, _build_prompt
    from ldqa.attention.loader import load_model
    from ldqa.attention.quant import set_prefill_gemm
    from ldqa.eval.bench.bench_block_scaling import kl_agreement

    qa = LongDocQA(store=args.out / "store", model=args.model)
    model, tok, chat = qa.llm.model, qa.llm.tokenizer, qa.chat_format(None)
    ref = load_model(qa.model_name, weights="fp32").model if args.reference == "fp32" else None
    m = args.new_tokens
    seconds = {g: [] for g in GEMMS}
    kl = {("fp32", g): [] for g in GEMMS if ref is not None} | {("bf16", "int8"): []}
    tokens = []
    for j, i in enumerate(order[: args.n]):
        ex = multidoc_example(records, i, args.passages, (1, 5, 10)[j % 3] if args.passages >= 10 else 1, args.seed)
        ps = [Passage(p["title"], p["text"]) for p in ex["passages"]]
        ids = _build_prompt(tok, ps, ex["question"], SimpleNamespace(instruction=None, answer_prefix=None), chat).ids()
        tokens.append(len(ids))
        if j == 0:  # each GEMM's weights made (and kept) before anything is timed
            for g in GEMMS:
                set_prefill_gemm(model, g)
                first_logprobs(model, ids, None, 1)
        lp, ys = {}, None
        for g in (GEMMS if j % 2 == 0 else GEMMS[::-1]):  # the first decodes greedily, the other is forced
            set_prefill_gemm(model, g)
            lp[g], greedy, s = first_logprobs(model, ids, ys, m)
            ys = greedy if ys is None else ys
            seconds[g].append(s)
        if ref is not None:
            lp["fp32"], _, _ = first_logprobs(ref, ids, ys, m)
        for a, b in kl:
            kl[(a, b)].append(kl_agreement(lp[a], lp[b]))
        print(f"{j + 1}/{args.n}: {len(ids)} tokens, prefill bf16 {seconds['bf16'][-1]:.2f} s, int8 "
              f"{seconds['int8'][-1]:.2f} s, KL(bf16 || int8) {kl[('bf16', 'int8')][-1][0]:.4f}", file=sys.stderr)
    set_prefill_gemm(model, qa.prefill_gemm)
    res = {"model": qa.model_name, "weights": qa.weights, "threads": torch.get_num_threads(), "prompts": args.n,
           "passages": args.passages, "new_tokens": m, "median_prompt_tokens": statistics.median(tokens),
           "prefill_s": {g: statistics.median(seconds[g]) for g in GEMMS},
           "bf16_over_int8": statistics.median(seconds["bf16"]) / statistics.median(seconds["int8"]),
           "kl": {f"{a} || {b}": summary(r) for (a, b), r in kl.items()}}
    (args.out / "prefill-gemm.json").write_text(json.dumps(res, indent=1))
    print(f"{res['model']} ({res['weights']}), {res['threads']} threads, {args.n} prompts, median "
          f"{res['median_prompt_tokens']:.0f} tokens: prefill bf16 {res['prefill_s']['bf16']:.2f} s, int8 "
          f"{res['prefill_s']['int8']:.2f} s ({res['bf16_over_int8']:.2f}x)")
    print("| reference || GEMM | KL, nats (SE) | top-1 agreement |\n|---|---|---|")
    for name, r in res["kl"].items():
        print(f"| {name} | {r['kl']:.4f} ({r['kl_se']:.4f}) | {r['top1_agreement']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
