"""Retrieval attention vs full attention while decoding, same model, same prefilled cache, one process
(docs/attention.md).

Parts (each selectable with --part):
  decode  contexts of --sizes tokens of essay text (../shared/data/pg-essays) plus a question; one exact
          (chunked) prefill; then --steps greedy decode steps with full attention and with retrieval
          attention (aware index, key-only index), each from the same prefilled cache. Reports per-step
          latency (whole forward), attention time per step of the global layers (the step's recorded
          queries against the cache: exact decode attention vs search + sparse attention + LSE merge),
          keys touched per step, recall@100 of the exact top-100 keys for the aware and the key-only index
          (the key-only one also at larger scan budgets), index build time and bytes, peak RSS.
  kv      the synthetic JSON key-value retrieval task (Lost in the Middle, section 3): --kv-files, --n
          examples each, the queried pair moved to a position cycling over 0/25/50/75/100% of the
          records; prompt as in the study; exact match of the value; full vs retrieval decode from one
          prefill. Resumable (JSONL).
  niah    needle in a haystack over the essays: --niah-sizes x depths 0/25/50/75/100%; a made-up needle
          ("The secret ingredient of the Korvel kiln glaze is smoked paprika."); correct = "paprika" in
          the answer; full vs retrieval decode from one prefill. Resumable (JSONL).

The prefill is always exact (chunks of --prefill-chunk tokens, each attending to everything before it),
so the two decodes start from identical caches: the difference is the decode attention alone.

    python -m ldqa.eval.bench.bench_retrieval --part decode --out out/bench-retrieval
    python -m ldqa.eval.bench.bench_retrieval --part kv --n 100 --out out/bench-retrieval
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from ldqa.attention.retrieval_attention import RetrievalConfig, RetrievalKV
from ldqa.indexes.key_index import KeyIndex, KeyIndexConfig, exact_top_k, recall_at_k
from ldqa.kernels import dispatch

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
NEEDLE = "The secret ingredient of the Korvel kiln glaze is smoked paprika."
NEEDLE_Q = "What is the secret ingredient of the Korvel kiln glaze?"
NEEDLE_A = "paprika"


def essays(data: Path) -> str:
    files = sorted((data / "pg-essays").glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays in {data / 'pg-essays'}: pass --data pointing at shared/data")
    return "\n\n".join(p.read_text(encoding="utf-8") for p in files)


def prefill(model, ids: list[int], chunk: int, extra: int = 64):
    """Exact chunked prefill: each chunk of `chunk` tokens attends to everything before it.

    Returns (cache, last logits (vocab,), queries): queries maps each global layer to the last prefill
    tokens' queries (1, hq, m, d), what `RetrievalKV.observe_prefill` keeps (the question's tokens end
    the prompt). The cache has room for `extra` decode tokens."""
    cache = model.new_cache(capacity=len(ids) + extra)
    observer = RetrievalKV(RetrievalConfig(), model.cfg.attn_scale)
    starts = list(range(0, len(ids), chunk))
    m = KeyIndexConfig().max_queries  # the last chunk must hold the queries RetrievalKV keeps
    if len(starts) > 1 and len(ids) - starts[-1] < m:
        starts[-1] = len(ids) - m
    for a, b in zip(starts, starts[1:] + [len(ids)]):
        cache.policy = observer if b == len(ids) else None
        logits = model(torch.tensor([ids[a:b]]), torch.arange(a, b), cache)
    cache.policy = None
    return cache, logits[0, -1], {layer: q[None] for layer, q in observer._queries.items()}


def with_queries(pol: RetrievalKV, queries: dict) -> RetrievalKV:
    for layer, q in queries.items():
        pol.observe_prefill(layer, q)
    return pol


class _Recorder(RetrievalKV):
    """A RetrievalKV that also keeps each step's queries per layer and times `attend` (ms)."""

    def __init__(self, cfg, scale, dense: bool):
        super().__init__(cfg, scale)
        self.dense, self.q, self.attend_ms = dense, {}, []

    def attend(self, layer, q, k, v):
        self.q.setdefault(layer, []).append(q[0, :, 0].clone())
        t0, b0 = time.perf_counter(), self.stats.build_ms
        out = dispatch.decode_attention(q, k, v, scale=self.scale)[0] if self.dense else super().attend(layer, q, k, v)
        # index builds happen inside the first step: reported separately (build_ms), not as attention time
        self.attend_ms.append((time.perf_counter() - t0) * 1000 - (self.stats.build_ms - b0))
        return out


def decode(model, cache, first_logits, n_steps: int, policy, stop_ids=()):
    """Greedy decode `n_steps` from a prefilled cache with `policy` (None = full attention); the cache is
    truncated back afterwards so the next run starts from the same state. Returns (tokens, step ms)."""
    n0 = cache.length
    cache.policy = policy
    toks, ms = [int(first_logits.argmax())], []
    try:
        for _ in range(n_steps - 1):
            if toks[-1] in stop_ids:
                break
            t0 = time.perf_counter()
            logits = model(torch.tensor([[toks[-1]]]), torch.tensor([cache.next_position()]), cache)
            ms.append((time.perf_counter() - t0) * 1000)
            toks.append(int(logits[0, -1].argmax()))
    finally:
        cache.policy = None
        cache.truncate(n0)
    return toks, ms


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------- decode

def _rcfg(args, **kw) -> RetrievalConfig:
    """The run's RetrievalConfig from the command line (kw overrides)."""
    base = dict(top_k_keys=args.top_k_keys, window=args.window, sink=args.sink, scan_fraction=args.scan_fraction,
                follow=args.follow, estimate=args.estimate == "on")
    return RetrievalConfig(**(base | kw))


def decode_part(llm, size: int, args) -> dict:
    model, tok, cfg = llm.model, llm.tokenizer, llm.model.cfg
    text_ids = tok.encode(essays(args.data))
    q_ids = tok.encode(f"\n\nQuestion: {args.question}\nAnswer:")
    ids = [tok.bos_id] + text_ids[: size - len(q_ids) - 1] + q_ids
    t0 = time.perf_counter()
    cache, first, queries = prefill(model, ids, args.prefill_chunk, extra=args.steps + 8)
    prefill_s = time.perf_counter() - t0
    glob = [i for i, t in enumerate(cfg.layer_types) if t == "full"]
    scale = cfg.attn_scale
    rcfg = lambda kind, **kw: _rcfg(args, index=kind, **kw)  # noqa: E731
    runs = {}
    for name, pol in (("full", _Recorder(rcfg("exact"), scale, dense=True)),
                      ("retrieval_aware", with_queries(_Recorder(rcfg("aware"), scale, dense=False), queries)),
                      ("retrieval_aware_no_follow_no_estimate",
                       with_queries(_Recorder(rcfg("aware", follow=0, estimate=False), scale, dense=False), queries)),
                      ("retrieval_keys", _Recorder(rcfg("keys"), scale, dense=False))):
        # the full run records too (dense attend), so its step time includes the same hook overhead
        toks, ms = decode(model, cache, first, args.steps, pol)
        per_step_attn = sum(pol.attend_ms) / max(1, len(ms))  # all global layers, one step
        runs[name] = {"tokens": toks, "median_step_ms": statistics.median(ms),
                      "attention_ms_per_step": per_step_attn, "stats": pol.stats.to_dict(),
                      "text": tok.decode(toks)}
        if name == "full":
            recorded = pol.q  # layer -> [q (hq, d) per step]: the exact decode's queries
    # recall@k (k = --recall-k, the target's 100, whatever top_k_keys the decode runs use) of the exact
    # top-k over the indexed zone, on the full run's queries (same for every index)
    L = cache.length
    end = L - args.window
    recall = {}
    for kind, fracs in (("aware", [args.scan_fraction]), ("keys", [args.scan_fraction, 0.05, 0.1, 0.3])):
        for frac in fracs:
            rs, touched, build_ms, nbytes, cover, oracle = [], [], 0.0, 0, [], []
            for layer in glob:
                keys = cache.keys(layer)[0, :, args.sink:end]  # (hkv, n, d)
                idx = KeyIndex(keys, args.sink, KeyIndexConfig(kind=kind, scan_fraction=frac), scale,
                               queries=queries[layer][0] if kind == "aware" else None)
                build_ms += idx.build_ms
                nbytes += idx.nbytes()
                kall = cache.keys(layer)[0].float()  # (hkv, L, d)
                for q in recorded[layer]:
                    res = idx.search(q, args.recall_k)
                    exact = exact_top_k(q, keys, args.recall_k, scale) + args.sink
                    rs.append(recall_at_k(res.slots, exact))
                    touched.append(res.scanned / keys.shape[0] / keys.shape[1])
                    cover.append(_mass(q, kall, res.slots, args.sink, end, scale))
                    if kind == "aware":
                        oracle.append(_mass(q, kall, exact, args.sink, end, scale))
            recall[f"{kind}@{frac}"] = {"recall_at_k": statistics.mean(rs), "min_recall": min(rs),
                                        "index_touched_fraction": statistics.mean(touched),
                                        "build_ms_all_layers": build_ms, "index_bytes": nbytes,
                                        "attention_mass_covered": statistics.mean(cover)}
            if oracle:
                recall["exact_top_k"] = {"attention_mass_covered": statistics.mean(oracle)}
    full_attn = runs["full"]["attention_ms_per_step"]
    row = {"model": llm.name, "context_tokens": L, "prefill_s": prefill_s, "steps": args.steps,
           "global_layers": glob, "top_k_keys": args.top_k_keys, "recall_k": args.recall_k, "window": args.window,
           "sink": args.sink,
           "runs": runs, "recall": recall, "kv_cache_bytes": cache.nbytes(), "peak_rss_mb": _rss_mb(),
           "attention_speedup": {k: full_attn / v["attention_ms_per_step"] for k, v in runs.items()},
           "step_speedup": {k: runs["full"]["median_step_ms"] / v["median_step_ms"] for k, v in runs.items()},
           "same_tokens_as_full": {k: v["tokens"] == runs["full"]["tokens"] for k, v in runs.items()}}
    print(json.dumps({k: row[k] for k in ("model", "context_tokens", "attention_speedup", "step_speedup",
                                          "recall", "same_tokens_as_full")}), file=sys.stderr)
    return row


# -------------------------------------------------------------------------------------- kv and niah

def _mass(q, keys, slots, sink: int, end: int, scale: float) -> float:
    """Exact attention mass (mean over query heads) on sink ∪ slots ∪ recent zone [end, L).
    q: (hq, d); keys: (hkv, L, d); slots: (hkv, k) cache slots (-1 padding)."""
    hkv, L, d = keys.shape
    p = torch.softmax(torch.einsum("hgd,hld->hgl", q.float().view(hkv, -1, d), keys) * scale, dim=-1)  # (hkv, g, L)
    sel = torch.zeros(hkv, L + 1, dtype=torch.bool)
    sel.scatter_(1, torch.where(slots >= 0, slots, L), True)
    sel = sel[:, :L]
    sel[:, :sink] = True
    sel[:, end:] = True
    return float((p * sel[:, None]).sum(-1).mean())


def kv_examples(path: Path, n: int, seed: int):
    rows = [json.loads(line) for line in gzip.open(path, "rt")]
    rng = random.Random(seed)
    idx = rng.sample(range(len(rows)), min(n, len(rows)))
    fracs = (0.0, 0.25, 0.5, 0.75, 1.0)
    for j, i in enumerate(idx):
        r = rows[i]
        recs = [tuple(p) for p in r["ordered_kv_records"] if p[0] != r["key"]]
        pos = round(fracs[j % len(fracs)] * len(recs))
        recs.insert(pos, (r["key"], r["value"]))
        data = "{" + ", ".join(f'"{k}": "{v}"' for k, v in recs) + "}"
        prompt = ("Extract the value corresponding to the specified key in the JSON object below.\n\n"
                  f"JSON data:\n{data}\n\nKey: \"{r['key']}\"\nCorresponding value: \"")
        yield {"i": i, "position": pos, "n_records": len(recs), "prompt": prompt, "answer": r["value"]}


def niah_examples(text_ids, tok, sizes, depths):
    needle = tok.encode(" " + NEEDLE + " ")
    tail = tok.encode(f"\n\nQuestion: {NEEDLE_Q}\nAnswer: The secret ingredient of the Korvel kiln glaze is")
    for size in sizes:
        hay = text_ids[: size - len(needle) - len(tail) - 1]
        for depth in depths:
            at = round(depth / 100 * len(hay))
            ids = [tok.bos_id] + hay[:at] + needle + hay[at:] + tail
            yield {"i": f"{size}@{depth}", "size": size, "depth": depth, "ids": ids, "answer": NEEDLE_A}


def task_part(llm, examples, rows_path: Path, args, max_new: int, scorer) -> dict:
    from tqdm import tqdm

    model, tok, cfg = llm.model, llm.tokenizer, llm.model.cfg
    done, seen = {}, [0]

    def refresh():  # rows appended since the last look (also by another process working from the other end)
        if rows_path.exists():
            with open(rows_path) as g:
                g.seek(seen[0])
                for line in g:
                    if not line.endswith("\n"):
                        break  # a row being written right now: read it next time
                    seen[0] += len(line.encode())
                    r = json.loads(line)
                    done.setdefault((str(r["i"]), r["mode"]), r)

    refresh()
    variants = {"retrieval": _rcfg(args)}  # mode -> RetrievalConfig
    if args.ablate:  # the pieces added to the plain index, each switched off
        flip = "off" if args.estimate == "on" else "on"
        variants |= {f"retrieval_estimate_{flip}": _rcfg(args, estimate=flip == "on"),
                     "retrieval_no_follow_no_estimate": _rcfg(args, follow=0, estimate=False)}
    modes = ("full", *variants)
    stop = set(tok.eos_ids) | {t for t in (tok.encode('"')[:1] + tok.encode("\n")[:1])}
    examples = list(examples)
    with open(rows_path, "a") as f:
        for ex in tqdm(examples[::-1] if args.reverse else examples, desc=rows_path.stem, file=sys.stderr):
            refresh()
            if all((str(ex["i"]), m) in done for m in modes):
                continue
            ids = ex["ids"] if "ids" in ex else [tok.bos_id] + tok.encode(ex["prompt"])
            cache, first, queries = prefill(model, ids, args.prefill_chunk, extra=max_new + 8)
            for mode in modes:
                if (str(ex["i"]), mode) in done:
                    continue
                pol = with_queries(RetrievalKV(variants[mode], cfg.attn_scale), queries) if mode != "full" else None
                toks, ms = decode(model, cache, first, max_new, pol, stop_ids=stop)
                pred = tok.decode(toks)
                row = {"i": ex["i"], "mode": mode, "context_tokens": len(ids), "prediction": pred,
                       "correct": float(scorer(pred, ex["answer"])), "median_step_ms": statistics.median(ms) if ms else None,
                       **{k: ex[k] for k in ("position", "n_records", "size", "depth") if k in ex}}
                if pol is not None:
                    row["keys_touched_fraction"] = pol.stats.to_dict()["keys_touched_fraction"]
                done[(str(ex["i"]), mode)] = row
                f.write(json.dumps(row) + "\n")
                f.flush()
            del cache
    refresh()
    rows = [done[(str(ex["i"]), m)] for ex in examples for m in modes if (str(ex["i"]), m) in done]
    summary = {}
    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        summary[m] = {"n": len(rs), "accuracy": sum(r["correct"] for r in rs) / max(1, len(rs))}
        touched = [r["keys_touched_fraction"] for r in rs if "keys_touched_fraction" in r]
        if touched:
            summary[m]["keys_touched_fraction"] = statistics.mean(touched)
    both = {str(r["i"]) for r in rows if r["mode"] == "full"} & {str(r["i"]) for r in rows if r["mode"] == "retrieval"}
    pred = {(str(r["i"]), r["mode"]): r["prediction"] for r in rows}
    summary["same_prediction_fraction"] = sum(pred[(i, "full")] == pred[(i, "retrieval")] for i in both) / max(1, len(both))
    summary["retrieval_minus_full_points"] = 100 * (summary["retrieval"]["accuracy"] - summary["full"]["accuracy"])
    return {"summary": summary, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["decode", "kv", "niah"], default="decode")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--sizes", default="8192,16384,32768")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--question", default="What does the author say is the best way to get startup ideas?")
    ap.add_argument("--top-k-keys", type=int, default=RetrievalConfig().top_k_keys,
                    help="keys retrieved per KV head per decode step (default: RetrievalConfig's)")
    ap.add_argument("--reverse", action="store_true",
                    help="kv/niah: work through the examples from the last; a second process started with it "
                         "on the same --out shares the work with a forward one (rows are re-read before each "
                         "example, so neither redoes the other's)")
    ap.add_argument("--recall-k", type=int, default=100,
                    help="decode: k of the recall@k of the exact top-k keys (independent of --top-k-keys)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--scan-fraction", type=float, default=0.02)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--ablate", action="store_true",
                    help="kv/niah: also decode with the estimation zone switched the other way, and with follow and "
                         "estimate both off")
    ap.add_argument("--follow", type=int, default=RetrievalConfig.follow,
                    help="carry-over of the previous step's best slots and their successors (0 = off)")
    ap.add_argument("--estimate", choices=["on", "off"], default="on" if RetrievalConfig.estimate else "off",
                    help="the estimation zone (cluster centroids for the keys not retrieved)")
    ap.add_argument("--kv-files", default="kv-retrieval-75_keys.jsonl.gz,kv-retrieval-140_keys.jsonl.gz")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--niah-sizes", default="4096,8192,16384")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("out/bench-retrieval"))
    args = ap.parse_args(argv)

    from ldqa.attention.loader import load_model

    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    llm = load_model(args.model)
    tag = Path(llm.name).name  # a model given as a path: its directory's name in the output file names
    result = {"model": llm.name, "threads": torch.get_num_threads(), "settings": {
        k: getattr(args, k) for k in ("top_k_keys", "window", "sink", "scan_fraction", "follow", "estimate",
                                     "prefill_chunk", "seed")}}
    if args.part == "decode":
        result["decode"] = [decode_part(llm, int(s), args) for s in args.sizes.split(",")]
    elif args.part == "kv":
        result["kv"] = {}
        for name in args.kv_files.split(","):
            exs = kv_examples(args.data / name, args.n, args.seed)
            rows_path = args.out / f"kv-{name.split('.')[0]}-{tag}.jsonl"
            res = task_part(llm, exs, rows_path, args, 40, lambda p, a: a in p)
            result["kv"][name] = res["summary"] | {"by_position": _by(res["rows"], "position")}
    else:
        text_ids = llm.tokenizer.encode(essays(args.data))
        exs = niah_examples(text_ids, llm.tokenizer, [int(s) for s in args.niah_sizes.split(",")],
                            [int(d) for d in args.depths.split(",")])
        res = task_part(llm, exs, args.out / f"niah-{tag}.jsonl", args, 8,
                        lambda p, a: a in p.lower())
        result["niah"] = res["summary"] | {"grid": {f"{r['size']}@{r['depth']}:{r['mode']}": r["correct"]
                                                    for r in res["rows"]}}
        _heatmap(res["rows"], args.out / f"niah-{tag}.png")
    result["peak_rss_mb"] = _rss_mb()
    name = f"results-{args.part}-{tag}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "decode"} |
                     {"decode": [{k: r[k] for k in ("context_tokens", "attention_speedup", "step_speedup", "recall")}
                                 for r in result.get("decode", [])]}, indent=1))
    return 0


def _by(rows, key) -> dict:
    out = {}
    for r in rows:
        out.setdefault(f"{r['mode']}@{r.get(key)}", []).append(r["correct"])
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def _heatmap(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, mode in zip(axes, ("full", "retrieval")):
        grid = [[next((r["correct"] for r in rows if r["mode"] == mode and r["size"] == s and r["depth"] == d),
                      float("nan")) for s in sizes] for d in depths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(sizes)), [f"{s // 1024}K" for s in sizes])
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_title(f"{mode} attention")
        ax.set_xlabel("context tokens")
    axes[0].set_ylabel("needle depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
