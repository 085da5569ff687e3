"""First-token time with each quantized layer's dequantized bf16 prefill weight kept ($LDQA_PREFILL_WEIGHTS=keep,
the default) against dequantizing it in every pass (dequantize), or (--against plain) kept weights packed
into oneDNN's GEMM layouts (`quant.PACK_PREFILL_WEIGHTS` and `quant.PACK_INT8_WEIGHTS`, the defaults)
against kept plain matrices, or (--against plain-int8) packed against plain int8 weights alone (bf16 ones
packed in both), side by side in one process.

    OMP_NUM_THREADS=2 python -m ldqa.eval.bench.bench_prefill_weights --model qwen2.5-coder-1.5b-instruct \
        [--n 4] [--passages 10] [--against dequantize|plain|plain-int8] [--out out/bench-prefill-weights]

NQ-open multi-doc prompts (the first --n seeded questions, gold passage first among --passages), the
passages' blocks stored and the block modes' bias curve fitted before timing. Each question is answered
(one token) in every mode of --modes, four rounds alternating dequantize, keep, dequantize, keep; the
kept weights are dropped before every dequantize round, so each keep round starts as a fresh process
would after its first prefill. Both settings compute with the same bf16 weights: the first tokens must
agree (`same_first_tokens`). With --against plain (plain-int8) the rounds alternate plain and packed kept
weights (packed when made), every round's weights made afresh by one untimed answer per mode first.
Reports per mode and setting the median TTFT, and dequantize (or plain) / keep; writes
OUT/prefill-weights.json and the kept weights' size in MB.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example

DEFAULT_MODES = "full,block,block/calibrate+reorder,block+recompute,block+recompute/calibrate+reorder"


def drop_kept(model) -> None:
    """Drop every kept bf16 prefill weight of `model` (`quant.QLinear.drop_prefill_weight`)."""
    for m in model.modules():
        if hasattr(m, "drop_prefill_weight"):
            m.drop_prefill_weight()


def kept_mb(model) -> float:
    """MB of prefill weights `model`'s layers hold now (`quant.QLinear.kept_prefill_bytes`)."""
    return sum(m.kept_prefill_bytes() for m in model.modules() if hasattr(m, "kept_prefill_bytes")) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=4, help="questions (the first of the seeded order)")
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--modes", default=DEFAULT_MODES, help="ATTENTION[/DEBIAS], comma-separated (debias: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--against", choices=("dequantize", "plain", "plain-int8"), default="dequantize",
                    help="the setting kept packed weights are compared with")
    ap.add_argument("--out", type=Path, default=Path("out/bench-prefill-weights"))
    args = ap.parse_args(argv)
    if not args.data.exists():
        raise SystemExit(f"--data {args.data}: not found (the NQ-open oracle file of ../shared/data)")
    modes = [tuple((m + "/none").split("/")[:2]) for m in args.modes.split(",")]

    from ldqa.app.api import LongDocQA, Passage
    from ldqa.attention import quant

    records = load_nq(args.data)
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    args.out.mkdir(parents=True, exist_ok=True)
    store = tempfile.TemporaryDirectory(prefix="kv-", dir=args.out)
    qa = LongDocQA(store=Path(store.name), model=args.model, kv_budget_mb=4096)
    model = qa.llm.model
    base = args.against
    pack_after = quant.PACK_AFTER_USES
    plain = base.startswith("plain")
    if plain:  # packed as soon as made, whatever --modes the warm-up answers run
        quant.PACK_AFTER_USES = 1
    times = {(m, d, s): [] for m, d in modes for s in (base, "keep")}
    firsts = {s: [] for s in (base, "keep")}
    tokens = []
    for i in order[: args.n]:
        ex = multidoc_example(records, i, args.passages, 1, args.seed)
        ps = [Passage(p["title"], p["text"]) for p in ex["passages"]]
        qa.answer(ex["question"], ps, attention="block", max_new_tokens=1, debias="calibrate+reorder")
        for setting in (base, "keep", base, "keep"):
            os.environ["LDQA_PREFILL_WEIGHTS"] = "dequantize" if setting == "dequantize" else "keep"
            quant.PACK_INT8_WEIGHTS = not (plain and setting == base)
            quant.PACK_PREFILL_WEIGHTS = setting != "plain"
            if plain or setting == "dequantize":
                drop_kept(model)
            if plain:  # this round's weights made (and packed or not) before it is timed
                for attention, debias in modes:
                    qa.answer(ex["question"], ps, attention=attention, max_new_tokens=1, debias=debias)
            for attention, debias in modes:
                if attention == "full":
                    qa.engine.clear_memo()
                ans = qa.answer(ex["question"], ps, attention=attention, max_new_tokens=1, debias=debias)
                times[(attention, debias, setting)].append(ans.timings.ttft_ms)
                firsts[setting].append(ans.text)
        tokens.append(ans.timings.prompt_tokens)
    quant.PACK_PREFILL_WEIGHTS, quant.PACK_INT8_WEIGHTS, quant.PACK_AFTER_USES = True, True, pack_after
    rows = {}
    for attention, debias in modes:
        name = attention if debias == "none" else f"{attention}/{debias}"
        d, k = (statistics.median(times[(attention, debias, s)]) for s in (base, "keep"))
        rows[name] = {f"{base}_ms": d, "keep_ms": k, f"{base}_over_keep": d / k}
    full = rows.get("full")
    for r in rows.values():
        if full:
            r["full_over_mode"] = {base: full[f"{base}_ms"] / r[f"{base}_ms"], "keep": full["keep_ms"] / r["keep_ms"]}
    res = {"model": qa.model_name, "weights": qa.weights, "threads": __import__("torch").get_num_threads(),
           "questions": args.n, "passages": args.passages, "against": base,
           "median_prompt_tokens": statistics.median(tokens), "kept_mb": kept_mb(model),
           "same_first_tokens": firsts[base] == firsts["keep"], "modes": rows}
    (args.out / "prefill-weights.json").write_text(json.dumps(res, indent=1))
    print(f"{res['model']} ({res['weights']}), {res['threads']} threads, {args.n} questions x 2 rounds, "
          f"median prompt {res['median_prompt_tokens']:.0f} tokens; kept weights {res['kept_mb']:.0f} MB; "
          f"same first tokens: {res['same_first_tokens']}")
    keep = "keep (packed)" if plain else "keep"
    print(f"| mode | {base} | {keep} | {base} / keep | full / mode ({base} -> keep) |\n|---|---|---|---|---|")
    for name, r in rows.items():
        ratio = (f"{r['full_over_mode'][base]:.1f}x -> {r['full_over_mode']['keep']:.1f}x"
                 if "full_over_mode" in r and name != "full" else "")
        print(f"| {name} | {r[f'{base}_ms'] / 1000:.2f} s | {r['keep_ms'] / 1000:.2f} s | "
              f"{r[f'{base}_over_keep']:.2f}x | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
