"""Prefill and decode speed with a fixed thread count against the thread governor (`ldqa.attention.threads`),
on an idle machine and next to a busy core, side by side in one process.

    python -m ldqa.eval.bench.bench_threads [--weights gguf] [--length 1416] [--new-tokens 64] [--repeats 3]
                                            [--hogs 0,1] [--out out/bench-threads]

For each number of hogs (busy-loop processes started for the measurement and stopped after it: 1 is
"another job on one of the cores") and each repetition, in a shuffled order: greedy decode of
`--new-tokens` tokens after the same prompt (`bench_runtime.prompt_ids`, the bundled sample) on torch's
default thread count, on one thread, with a fresh governor per run (`DecodeThreads`: a first answer,
which pays for finding the count), and with one governor kept across the runs of a busy-process setting
after an untimed warm-up answer (what later answers of a running ldqa get: only the periodic probes).
The prefill runs as the app runs it (`prefill_on`): on the governor's last choice once it has measured
both counts (a first answer: probing its first layers on each count, "probe -> n"), on the fixed count
otherwise. Reports prefill ms and
decode tokens/s (medians of the repetitions, and each), the counts used, and whether the runs gave the
same tokens. Writes `OUT/bench-threads.json`. The load
average is printed: with other jobs on the machine the idle rows are not idle.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from pathlib import Path

import torch


def _hog(stop) -> None:  # a busy loop until told to stop (one core's worth of another job)
    while not stop.is_set():
        sum(range(10_000))


def _decode(lm, ids, new_tokens, threads):
    """Prefill `ids` and decode `new_tokens` greedy tokens as the app does: the prefill on the governor's
    last choice or probing (`prefill_on`; a fixed count: that count), each decode step on `threads`.
    Returns (token ids, decode tokens/s, prefill ms, the prefill probe's choice or None)."""
    from ldqa.attention.generate import SamplingConfig, start_generation
    from ldqa.attention.threads import prefill_on

    prev = torch.get_num_threads()
    if isinstance(threads, int):
        torch.set_num_threads(threads)
    try:
        with prefill_on(threads, lm.model) as probe:
            t0 = time.perf_counter()
            gen = start_generation(lm.model, ids, lm.tokenizer.decode, [], SamplingConfig(max_new_tokens=new_tokens))
            prefill_ms = (time.perf_counter() - t0) * 1e3
    finally:
        torch.set_num_threads(prev)
    gen.threads = threads
    for _ in gen:
        pass
    return gen.token_ids, gen.stats.tokens_per_s, prefill_ms, probe.chosen


def main(argv=None) -> int:
    from ldqa.attention.loader import load_model
    from ldqa.attention.threads import DecodeThreads
    from ldqa.eval.bench.bench_runtime import prompt_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--length", type=int, default=1416)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hogs", default="0,1", help="busy processes beside the measurement, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("out/bench-threads"))
    args = ap.parse_args(argv)
    most = torch.get_num_threads()
    lm = load_model(args.model, weights=args.weights)
    ids = prompt_ids(lm.tokenizer, args.length)
    learned: dict = {}
    configs = {f"{most} threads": lambda: None, "1 thread": lambda: 1, "governor, first answer": lambda: DecodeThreads(most),
               "governor, later answers": lambda: learned["gov"]}
    rows = []
    print(f"load average {os.getloadavg()[0]:.1f}; torch threads {most}; {args.model} {args.weights}; "
          f"prompt {len(ids)} tokens, {args.new_tokens} new")
    for hogs in (int(h) for h in args.hogs.split(",")):
        stop = mp.Event()
        procs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(hogs)]
        for p in procs:
            p.start()
        time.sleep(0.5 if hogs else 0)
        try:
            learned["gov"] = DecodeThreads(most)
            _decode(lm, ids, args.new_tokens, learned["gov"])  # warm-up: the governor learns this setting
            res = {name: [] for name in configs}
            for rep in range(args.repeats):
                order = list(configs)
                random.Random(rep).shuffle(order)
                for name in order:
                    threads = configs[name]()
                    pre = (threads.prefill_count() if isinstance(threads, DecodeThreads) else threads) or most
                    toks, tps, prefill_ms, probed = _decode(lm, ids, args.new_tokens, threads)
                    pre = f"probe -> {probed}" if probed else pre
                    choice = threads.best if isinstance(threads, DecodeThreads) else threads or most
                    res[name].append((tps, toks, choice, prefill_ms, pre))
                    print(f"hogs {hogs} rep {rep} {name}: prefill {prefill_ms:.0f} ms on {pre}, {tps:.1f} tok/s "
                          f"(decode on {choice})", flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join()
        first = next(iter(res.values()))[0][1]
        for name, runs in res.items():
            rows.append(dict(hogs=hogs, config=name, tok_s=statistics.median(r[0] for r in runs),
                             tok_s_each=[round(r[0], 2) for r in runs], final_threads=[r[2] for r in runs],
                             prefill_ms=statistics.median(r[3] for r in runs),
                             prefill_ms_each=[round(r[3]) for r in runs], prefill_threads=[r[4] for r in runs],
                             same_tokens=all(r[1] == first for r in runs)))
    print("| busy processes beside | threads | prefill ms (median) | each | prefill on | tokens/s (median) | each | "
          "final decode thread count | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hogs']} | {r['config']} | {r['prefill_ms']:.0f} | {' / '.join(map(str, r['prefill_ms_each']))} | "
              f"{' / '.join(map(str, r['prefill_threads']))} | {r['tok_s']:.1f} | {' / '.join(map(str, r['tok_s_each']))} | "
              f"{' / '.join(map(str, r['final_threads']))} | {r['same_tokens']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-threads.json").write_text(json.dumps(dict(rows=rows, load=os.getloadavg()[0], threads=most,
                                                                 model=args.model, weights=args.weights), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
