"""Where block reuse loses its points, and which recomputed tokens win them back: every variant of one
question in one process, paired with full attention on the same model, prompt and passages.

NQ-open multi-doc (eval/nq.py: the gold passage and 9 distractors, gold at each of --positions), greedy
answers of at most --max-new-tokens, best-subspan EM, no debiasing (the passages stay where they are put).
Variants (--variants, comma-separated):
  full                      exact attention over the whole prompt
  block                     stored passage blocks, only the question computed (after block mode's
                            default anchor passages; block/anchor=N for another number; block/measured=1
                            (--part ttft) answers with calibrate+reorder, as block mode does by default)
  SELECT@R                  block+recompute of the fraction R of the passage tokens chosen by SELECT
                            (`block_attention.SELECT_METHODS`: question, deviation, lead)
  question@R/K=V[,K=V]      the same with the selection's settings (`BlockRuntime`): layers=L ranks by
                            the first L layers only (the selection pass stops there), window=W tokens,
                            score=mean|max|last (`block_attention.SELECT_SCORES`), skip_first=1 never
                            chooses the first passage; whole=N recomputes the N passages the
                            question attends to most whole, the windows taking the rest; refine=F
                            chooses the share F of the passage tokens in a second round, ranked again
                            over the cache with the rest recomputed (`BlockRuntime.select_refine`); measured=1
                            (--part kl) ranks by the question's attention measured over the plain block
                            cache in two other orders (a seeded shuffle and its reverse), as
                            block+recompute does under calibrate+reorder
                            (--part ttft: the answer runs with calibrate+reorder; batch_orders=0
                            measures the two orders in a pass each, not in one batched pass);
                            debias=M (--part ttft; also block/debias=M) answers with debias method M,
                            calibrate or calibrate+reorder;
                            taper=J:T recomputes only the best T share from layer J on (gradual filtering,
                            `BlockRuntime.taper`); causal_group=G: the recompute pass's global
                            attention in groups of G queries (`model.CAUSAL_GROUP`; 100000: one group);
                            gemm=int8 multiplies the recomputed tokens and the ranking passes with the
                            int8 prefill GEMM, the question's rows in bf16 (`BlockRuntime.recompute_gemm`);
                            gemm=int8q the question's rows of the final pass too, but the last row at the
                            last layer (`BlockRuntime.question_int8`);
                            anchor=N encodes every passage block after N anchor passages
                            (`prompt.anchor_ids`; also `block/anchor=N`);
                            max_tokens=T recomputes at most T passage tokens, the share falling past
                            T / R tokens (`BlockRuntime.recompute_max_tokens`)
  oracle                    block+recompute of the gold passage whole (the answer's passage), nothing else
Recomputing every token (e.g. question@1.0) must give full attention's answers: `same_as_full` says how
many do. The passages' blocks are stored before a question's variants run, so every TTFT is warm. Per variant: EM by gold position, the paired difference from full (points, SE), answers that
ran to the token cap, median TTFT and the tokens recomputed. Resumable: one JSON row per answer in
OUT/rows.jsonl; the summary in OUT/summary.json and as a Markdown table on stdout.

    OMP_NUM_THREADS=1 python -m ldqa.eval.bench.bench_recompute --model gemma3-270m --n 40 --out out/recompute-gemma
    python -m ldqa.eval.bench.bench_recompute --part ttft --passages 5 --n 5 --out out/recompute-ttft
    python -m ldqa.eval.bench.bench_recompute --part ttft --decode-tokens 8 ...   # as an app on a busy machine
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

from ldqa.eval.metrics import best_subspan_em
from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example

DEFAULT_VARIANTS = "full,block,oracle,lead@0.12,deviation@0.15,question@0.1,question@0.2,question@1.0"
TTFT_DEBIAS = ("calibrate", "calibrate+reorder")  # debias=M of a --part ttft variant: the method it answers with


def parse_variant(spec: str) -> dict:
    """The `LongDocQA.answer` keywords of variant `spec` (see the module docstring), without the gold
    passage's rank (filled per question for "oracle"). Raises ValueError for an unknown variant."""
    from ldqa.attention.block_attention import SELECT_METHODS

    if spec in ("full", "block"):
        return {"attention": spec}
    if spec.startswith("block/"):  # block/anchor=N,measured=0|1
        kw = {"attention": "block"}
        for item in spec.partition("/")[2].split(","):
            k, _, v = item.partition("=")
            if k == "anchor" and v.isdigit():
                kw["anchor_passages"] = int(v)
            elif k == "measured" and v in ("0", "1"):
                kw["measured"] = v == "1"
            elif k == "debias" and v in TTFT_DEBIAS:
                kw["debias"] = v
            elif k == "batch_orders" and v in ("0", "1"):
                kw["batch_orders"] = v == "1"
            else:
                break
        else:
            return kw
    if spec == "oracle":
        return {"attention": "block+recompute", "recompute_select": "oracle"}
    from ldqa.attention.block_attention import SELECT_SCORES

    name, _, rest = spec.partition("@")
    ratio, _, extra = rest.partition("/")
    settings = {}
    try:
        r = float(ratio)
        for item in filter(None, extra.split(",")):
            k, _, v = item.partition("=")
            if k in ("layers", "window") and int(v) >= 1:
                settings["select_" + k] = int(v)
            elif k == "score" and v in SELECT_SCORES:
                settings["select_score"] = v
            elif k == "skip_first" and v in ("0", "1"):
                settings["select_skip_first"] = v == "1"
            elif k == "whole" and v.isdigit():
                settings["select_whole"] = int(v)
            elif k == "refine" and 0 <= float(v) <= 1:
                settings["select_refine"] = float(v)
            elif k == "measured" and v in ("0", "1"):
                settings["measured"] = v == "1"
            elif k == "debias" and v in TTFT_DEBIAS:
                settings["debias"] = v
            elif k == "batch_orders" and v in ("0", "1"):
                settings["batch_orders"] = v == "1"
            elif k == "causal_group" and int(v) >= 1:
                settings["causal_group"] = int(v)
            elif k == "gemm" and v in ("bf16", "int8", "int8q"):
                settings["recompute_gemm"] = v[:4]
                settings["question_int8"] = v == "int8q"
            elif k == "anchor" and v.isdigit():
                settings["anchor_passages"] = int(v)
            elif k == "max_tokens" and v.isdigit():
                settings["recompute_max_tokens"] = int(v)
            elif k == "taper":
                j, _, t = v.partition(":")
                if int(j) < 1 or not 0 <= float(t) <= 1:
                    raise ValueError
                settings["taper"] = (int(j), float(t))
            else:
                raise ValueError
    except ValueError:
        r = None
    if name in SELECT_METHODS and r is not None and 0 <= r <= 1 and (not settings or name == "question"):
        return {"attention": "block+recompute", "recompute_select": name, "recompute_ratio": r, **settings}
    raise ValueError(f"variant {spec!r}: use full, block, oracle, SELECT@R with SELECT one of "
                     f"{', '.join(SELECT_METHODS)} and R in [0, 1], or "
                     "question@R/layers=L,window=W,score=S,skip_first=0|1,whole=N,refine=F,measured=0|1,debias=M,"
                     "batch_orders=0|1,taper=J:T,causal_group=G,gemm=bf16|int8,anchor=N,max_tokens=T, or "
                     f"block/anchor=N,measured=0|1,debias=M,batch_orders=0|1 (M: {' or '.join(TTFT_DEBIAS)})")


def split_variants(text: str) -> list[str]:
    """--variants' comma-separated list, where a variant's own settings may hold commas too
    ("full,question@0.3/measured=1,taper=14:0.15" is two variants): a comma starts a variant only before
    full, block, oracle or SELECT@."""
    from ldqa.attention.block_attention import SELECT_METHODS

    methods = "|".join(SELECT_METHODS)
    return re.split(rf",(?=(?:full|block|oracle)(?:,|$|/)|(?:{methods})@)", text)


SELECTION = ("select_layers", "select_window", "select_score", "select_skip_first", "select_whole", "select_refine",
             "taper", "recompute_gemm", "question_int8", "recompute_max_tokens")  # what a variant may set


@contextmanager
def selection(qa, kw: dict):
    """A variant's selection settings (the `SELECTION` keys of `kw`, popped) on the block runtime of `qa`
    for the `with` block, restored after."""
    from ldqa.attention import engine, model

    rt = qa.engine.block_runtime
    new = {k: kw.pop(k) for k in SELECTION if k in kw}
    group = kw.pop("causal_group", model.CAUSAL_GROUP)
    batch = kw.pop("batch_orders", engine.BATCH_ORDERS)
    before = {k: getattr(rt, k) for k in new}
    for k, v in new.items():
        setattr(rt, k, v)
    model.CAUSAL_GROUP, group = group, model.CAUSAL_GROUP
    engine.BATCH_ORDERS, batch = batch, engine.BATCH_ORDERS
    try:
        yield
    finally:
        model.CAUSAL_GROUP = group
        engine.BATCH_ORDERS = batch
        for k, v in before.items():
            setattr(rt, k, v)


def answer(qa, question, passages, **kw):
    """`qa.answer` with a variant's keywords (its selection settings on the block runtime for the call)."""
    with selection(qa, kw):
        return qa.answer(question, passages, **kw)


def answer_rows(qa, records, idx, positions, variants, n_passages, max_new, seed, rows_path: Path) -> dict:
    """Answer every (question, gold position, variant) not in `rows_path` yet, appending its row; returns
    every row by (record, position, variant)."""
    from tqdm import tqdm

    done = {}
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["i"], r["gold_position"], r["variant"])] = r
    with open(rows_path, "a") as f:
        for i in tqdm(idx, desc="questions", file=sys.stderr):
            for pos in positions:
                ex = multidoc_example(records, i, n_passages, pos, seed)
                todo = [v for v in variants if (i, pos, v) not in done]
                if any(v != "full" for v in todo):  # store the passages' blocks first: every TTFT is warm
                    qa.answer(ex["question"], ex["passages"], attention="block", max_new_tokens=1, debias="none")
                for spec in todo:
                    kw = parse_variant(spec)
                    if kw.get("recompute_select") == "oracle":
                        kw["recompute_select"] = (pos,)
                    ans = answer(qa, ex["question"], ex["passages"], max_new_tokens=max_new, debias="none", **kw)
                    t = ans.timings
                    row = {"i": i, "gold_position": pos, "variant": spec, "prediction": ans.text,
                           "em": best_subspan_em(ans.text, ex["answers"]), "ttft_ms": t["ttft_ms"],
                           "prompt_tokens": t["prompt_tokens"], "generated_tokens": t["generated_tokens"],
                           "at_cap": t["generated_tokens"] >= max_new,
                           "tokens_recomputed": t.get("tokens_recomputed", 0),
                           "attention_used": ans.settings.get("attention_used", kw["attention"])}
                    done[(i, pos, spec)] = row
                    f.write(json.dumps(row) + "\n")
                    f.flush()
    return done


def summarize(done: dict, idx, positions, variants) -> dict:
    """Per variant: n, EM overall and by gold position, the paired difference from full (points, SE,
    overall and by position), answers at the cap, same_as_full (identical predictions), median TTFT (ms),
    mean tokens recomputed."""
    out = {}
    keys = [(i, p) for i in idx for p in positions]
    for spec in variants:
        rows = [done[(i, p, spec)] for i, p in keys if (i, p, spec) in done]
        if not rows:
            continue
        s = {"n": len(rows), "em": statistics.fmean(r["em"] for r in rows),
             "em_by_position": {p: statistics.fmean(r["em"] for r in rows if r["gold_position"] == p)
                                for p in positions if any(r["gold_position"] == p for r in rows)},
             "at_cap": sum(r["at_cap"] for r in rows),
             "median_ttft_ms": statistics.median(r["ttft_ms"] for r in rows),
             "mean_tokens_recomputed": statistics.fmean(r["tokens_recomputed"] for r in rows),
             "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in rows)}
        if spec != "full":
            pairs = [(done[(i, p, spec)], done[(i, p, "full")]) for i, p in keys
                     if (i, p, spec) in done and (i, p, "full") in done]
            if len(pairs) > 1:
                d = [a["em"] - b["em"] for a, b in pairs]
                s["minus_full_points"] = 100 * statistics.fmean(d)
                s["paired_se_points"] = 100 * statistics.stdev(d) / len(d) ** 0.5
                s["minus_full_by_position"] = {
                    p: 100 * statistics.fmean(a["em"] - b["em"] for a, b in pairs if a["gold_position"] == p)
                    for p in positions if any(a["gold_position"] == p for a, _ in pairs)}
                s["same_as_full"] = sum(a["prediction"] == b["prediction"] for a, b in pairs)
                s["n_paired"] = len(pairs)
        out[spec] = s
    return out


def markdown(summary: dict, positions) -> str:
    """The summary as a Markdown table (EM by gold position, difference from full, cap, TTFT)."""
    head = ("| variant | " + " | ".join(f"EM gold {p}" for p in positions)
            + " | EM | - full (SE) | same as full | at cap | TTFT median | recomputed |")
    lines = [head, "|" + "---|" * (len(positions) + 7)]
    for spec, s in summary.items():
        diff = (f"{s['minus_full_points']:+.1f} ({s['paired_se_points']:.1f})" if "minus_full_points" in s else "")
        same = f"{s['same_as_full']}/{s['n_paired']}" if "same_as_full" in s else ""
        lines.append(f"| {spec} | " + " | ".join(f"{s['em_by_position'].get(p, float('nan')):.3f}" for p in positions)
                     + f" | {s['em']:.3f} | {diff} | {same} | {s['at_cap']}/{s['n']} | "
                       f"{s['median_ttft_ms'] / 1000:.2f} s | {s['mean_tokens_recomputed']:.0f} of "
                       f"{s['mean_prompt_tokens']:.0f} |")
    return "\n".join(lines)


def ttft_part(qa, records, idx, variants, n_passages: int, seed: int, repeats: int, decode_tokens: int = 1,
              profile: bool = False) -> dict:
    """Warm TTFT (ms) of each variant over the same prompts: the first len(idx) questions, gold passage
    first among `n_passages`, `repeats` times each. Every variant but full attention answers each question
    once untimed first, so its passage blocks (keyed by its anchor passages) are stored and its bias curve
    fitted before it is timed; full attention's memo of exact prefills is cleared before each of its runs.
    Each answer generates at most `decode_tokens` tokens: 1 times the first token alone; more lets the
    decode thread governor (`threads.DecodeThreads`) measure its steps, so later prefills run on the count
    it chose, as in an app that answers in full. Returns per variant the median TTFT and full's median
    over it (the speed-up), the prompt tokens, and how many timed answers encoded a block (0 when every
    time is warm). profile: each variant answers the last question once more under `torch.profiler`, and
    "profile" gives per variant the ops with the most self CPU time (ms), untimed otherwise."""
    from ldqa.app.api import Passage

    def run(spec, question, ps):
        kw = parse_variant(spec)
        if kw.get("recompute_select") == "oracle":
            kw["recompute_select"] = (1,)
        if spec == "full":
            qa.engine.clear_memo()
        measured = kw.pop("measured", False)
        debias = kw.pop("debias", None) or ("calibrate+reorder" if measured else "none")
        return answer(qa, question, ps, max_new_tokens=decode_tokens, debias=debias, **kw).timings

    times = {v: [] for v in variants}
    tokens, cold = [], 0
    for i in idx:
        ex = multidoc_example(records, i, n_passages, 1, seed)
        ps = [Passage(p["title"], p["text"]) for p in ex["passages"]]
        for spec in variants:
            if spec != "full":
                run(spec, ex["question"], ps)  # stores the blocks, fits the curve: not timed
        for _ in range(repeats):
            for spec in variants:
                t = run(spec, ex["question"], ps)
                times[spec].append(t["ttft_ms"])
                cold += bool(t.to_dict().get("encode_ms"))
        tokens.append(t["prompt_tokens"])
    med = {v: statistics.median(x) for v, x in times.items()}
    res = {"passages": n_passages, "questions": len(idx), "repeats": repeats, "timed_runs_encoding": cold,
           "median_prompt_tokens": statistics.median(tokens), "median_ttft_ms": med,
           "full_over_variant": {v: med["full"] / m for v, m in med.items() if v != "full"}}
    if profile:
        import torch

        res["profile"] = {}
        for spec in variants:
            with torch.profiler.profile() as prof:
                run(spec, ex["question"], ps)
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:PROFILE_OPS]
            res["profile"][spec] = {e.key: round(e.self_cpu_time_total / 1000, 1) for e in ops}
    return res


PROFILE_OPS = 8  # ops listed per variant by --profile


def measured(qa, ps: list, question: str, chat, rng: random.Random, anchor: list[int] = ()) -> list:
    """The selection scores block+recompute gets under calibrate+reorder (`debias.measured_scores`), for the
    passages `ps` in their order: the question's attention per slot over the plain block cache with the
    passages in a shuffled order and in its reverse, averaged per passage."""
    from types import SimpleNamespace

    import torch

    from ldqa.app.api import _build_prompt
    from ldqa.attention.block_attention import DEFAULT_HEADERS
    from ldqa.attention.debias import DebiasKV, measured_scores, passage_mass, passage_spans

    model, rt = qa.llm.model, qa.engine.block_runtime
    order = list(range(len(ps)))
    rng.shuffle(order)
    ctxs = []
    for o in (order, order[::-1]):
        seg = _build_prompt(qa.llm.tokenizer, [ps[i] for i in o], question,
                            SimpleNamespace(instruction=None, answer_prefix=None), chat).with_anchor(list(anchor))
        rec = DebiasKV(n_record=len(seg.question), scale=model.cfg.attn_scale)
        c, _, _ = rt.prefill(seg, [None] * len(ps), mode="block", policy=rec, headers=DEFAULT_HEADERS)
        L = c.length
        _, tokens = passage_mass(model, c, rec.queries, passage_spans(seg), torch.arange(L - len(seg.question), L),
                                 tokens=True)
        ctxs.append(SimpleNamespace(prompt=seg, token_mass=tokens))
    return measured_scores(ctxs[0], ctxs[1], [ps[i] for i in order], ps)


def kl_positions(n_passages: int) -> tuple[int, ...]:
    """The gold positions (1-based) the kl part takes in turn: first, middle and last of 10 or more
    passages, else the first only."""
    return (1, (n_passages + 1) // 2, n_passages) if n_passages >= 10 else (1,)


def kl_part(qa, records, idx, variants, n_passages: int, seed: int, new_tokens: int) -> dict:
    """How close each variant's next-token distributions come to full attention's, without generating:
    for each question of `idx` (gold first, in the middle and last in turn: 1, 5, 10 of 10 passages),
    full attention answers greedily for `new_tokens` tokens; every other variant is teacher-forced on
    those tokens. Per variant: the mean KL(full || variant) over those positions (nats) with its SE over
    questions, how often the two agree on the most likely token, and the mean tokens recomputed. A cheap,
    low-variance proxy for the accuracy part (paired EM needs hundreds of answers to resolve a few points)."""
    from types import SimpleNamespace

    import torch
    from tqdm import tqdm

    from ldqa.app.api import Passage, _build_prompt
    from ldqa.app.prompt import anchor_ids
    from ldqa.attention.block_attention import DEFAULT_HEADERS
    from ldqa.eval.bench.bench_block_scaling import kl_agreement

    model, tok, rt = qa.llm.model, qa.llm.tokenizer, qa.engine.block_runtime
    chat = qa.chat_format(None)
    per = {v: [] for v in variants if v != "full"}
    positions = kl_positions(n_passages)
    for j, i in enumerate(tqdm(idx, desc="questions", file=sys.stderr)):
        pos = positions[j % len(positions)]
        ex = multidoc_example(records, i, n_passages, pos, seed)
        ps = [Passage(p["title"], p["text"]) for p in ex["passages"]]
        seg = _build_prompt(tok, ps, ex["question"], SimpleNamespace(instruction=None, answer_prefix=None), chat)
        ids = seg.ids()
        m = new_tokens
        with torch.no_grad():
            cache = model.new_cache(capacity=len(ids) + m + 8)
            logits = model(torch.tensor([ids]), torch.arange(len(ids)), cache)
            firsts, ys = [logits[0, -1]], []
            for _ in range(m):
                ys.append(int(logits[0, -1].argmax()))
                logits = model(torch.tensor([[ys[-1]]]), torch.tensor([cache.length]), cache)
                firsts.append(logits[0, -1])
            lp_full = torch.log_softmax(torch.stack(firsts[:m]).float(), -1)  # (m, vocab)
            for spec in per:
                kw = parse_variant(spec)
                mode = kw["attention"]
                select = (pos,) if kw.get("recompute_select") == "oracle" else kw.get("recompute_select", "question")
                anchor = anchor_ids(tok, kw.pop("anchor_passages", 0), None, chat)
                with selection(qa, {k: kw[k] for k in ("recompute_gemm",) if k in kw}), rt.ranking_only():
                    scores = measured(qa, ps, ex["question"], chat, random.Random(f"{seed}-{i}"), anchor) if kw.pop(
                        "measured", False) else None  # (as the engine measures)
                sg = _build_prompt(tok, ps, ex["question"], SimpleNamespace(instruction=None, answer_prefix=None),
                                   chat).with_anchor(anchor)
                with selection(qa, kw):
                    c, last, stats = rt.prefill(sg, [None] * len(ps), mode=mode,
                                                recompute_ratio=kw.get("recompute_ratio", 0.0),
                                                extra_capacity=m + 8, headers=DEFAULT_HEADERS, select=select,
                                                scores=scores)
                rest = model(torch.tensor([ys[:-1]]), torch.arange(c.length, c.length + m - 1), c, all_logits=True)[0]
                lp = torch.log_softmax(torch.cat([last[0], rest]).float(), -1)
                kl, agree = kl_agreement(lp_full, lp)
                per[spec].append((kl, agree, stats.tokens_recomputed, pos))
    out = {}
    for spec, rows in per.items():
        kls = [r[0] for r in rows]
        out[spec] = {"n": len(rows), "kl": statistics.fmean(kls),
                     "kl_se": statistics.stdev(kls) / len(kls) ** 0.5 if len(kls) > 1 else 0.0,
                     "top1_agreement": statistics.fmean(r[1] for r in rows),
                     "kl_by_position": {p: statistics.fmean(r[0] for r in rows if r[3] == p)
                                        for p in sorted({r[3] for r in rows})},
                     "mean_tokens_recomputed": statistics.fmean(r[2] for r in rows)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--n", type=int, default=40, help="questions (a seeded sample; a larger n extends a smaller)")
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--positions", default="1,5,10", help="gold positions (1-based)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=Path("out/bench-recompute"))
    ap.add_argument("--part", choices=["accuracy", "ttft", "kl"], default="accuracy",
                    help="ttft: warm TTFT of each variant at --passages (gold first), --n questions x --repeats, "
                         "at the process's torch threads; kl: KL(full || variant) over full attention's first "
                         "--new-tokens answer tokens, --n questions from the end of the seeded order (none of "
                         "the accuracy part's), gold first, in the middle and last in turn (1, 5, 10 of 10)")
    ap.add_argument("--new-tokens", type=int, default=8, help="kl: answer tokens teacher-forced")
    ap.add_argument("--repeats", type=int, default=3, help="ttft: runs of each variant per question")
    ap.add_argument("--profile", action="store_true",
                    help="ttft: profile one more answer of each variant (torch.profiler) and list its costliest ops")
    ap.add_argument("--decode-tokens", type=int, default=1,
                    help="ttft: tokens each answer generates (1: the first only; more lets the decode thread "
                         "governor choose the count later prefills run on, as an app answering in full does)")
    args = ap.parse_args(argv)
    variants = split_variants(args.variants)
    for v in variants:
        parse_variant(v)
    if "full" not in variants:
        raise SystemExit("--variants must include full (every variant is paired with it)")
    if args.part == "accuracy" and any(parse_variant(v).get("measured") for v in variants):
        raise SystemExit("measured=1 is a setting of --part kl and --part ttft only")
    if args.part == "kl" and any(v.startswith("block/") and parse_variant(v).get("measured") for v in variants):
        raise SystemExit("block/measured=1 is a setting of --part ttft only")
    if args.part != "ttft" and any("debias" in parse_variant(v) for v in variants):
        raise SystemExit("debias=M is a setting of --part ttft only")
    if args.decode_tokens < 1:
        raise SystemExit(f"--decode-tokens {args.decode_tokens}: use 1 or more")
    positions = [int(p) for p in args.positions.split(",")]
    if args.part == "accuracy" and any(not 1 <= p <= args.passages for p in positions):
        raise SystemExit(f"--positions {args.positions}: each must be in 1..{args.passages}")
    if not args.data.exists():
        raise SystemExit(f"--data {args.data}: not found (the NQ-open oracle file of ../shared/data)")

    from ldqa.app.api import LongDocQA

    records = load_nq(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    idx = order[: args.n]
    store = tempfile.TemporaryDirectory(prefix="kv-", dir=args.out)  # the passages' blocks, removed on return
    qa = LongDocQA(store=Path(store.name), model=args.model, kv_budget_mb=4096)
    if args.part == "kl":
        res = {"model": qa.model_name, "weights": qa.weights, "n": args.n, "new_tokens": args.new_tokens,
               "variants": kl_part(qa, records, order[-args.n:], variants, args.passages, args.seed,
                                   args.new_tokens)}
        (args.out / "kl.json").write_text(json.dumps(res, indent=1))
        gold = " / ".join(map(str, kl_positions(args.passages)))
        print(f"| variant | KL(full || variant) (SE) | KL gold {gold} | top-1 agreement | recomputed |\n"
              "|---|---|---|---|---|")
        for v, r in res["variants"].items():
            by = " / ".join(f"{x:.3f}" for x in r["kl_by_position"].values())
            print(f"| {v} | {r['kl']:.3f} ({r['kl_se']:.3f}) | {by} | {r['top1_agreement']:.3f} | "
                  f"{r['mean_tokens_recomputed']:.0f} |")
        return 0
    if args.part == "ttft":
        qa.warm_up()
        res = {"model": qa.model_name, "weights": qa.weights, "threads": __import__("torch").get_num_threads(),
               "decode_tokens": args.decode_tokens,
               **ttft_part(qa, records, idx, variants, args.passages, args.seed, args.repeats, args.decode_tokens,
                           args.profile)}
        (args.out / f"ttft-{args.passages}.json").write_text(json.dumps(res, indent=1))
        print("| variant | TTFT median | full / variant |\n|---|---|---|")
        for v, m in res["median_ttft_ms"].items():
            print(f"| {v} | {m / 1000:.2f} s | {res['full_over_variant'].get(v, 1.0):.1f}x |")
        for v, ops in res.get("profile", {}).items():
            print(f"\n{v}, one answer's costliest ops (self CPU ms): " + ", ".join(f"{k} {ms}" for k, ms in ops.items()))
        return 0
    done = answer_rows(qa, records, idx, positions, variants, args.passages, args.max_new_tokens, args.seed,
                       args.out / "rows.jsonl")
    summary = summarize(done, idx, positions, variants)
    result = {"model": qa.model_name, "weights": qa.weights, "n_questions": len(idx), "positions": positions,
              "passages": args.passages, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "threads": __import__("torch").get_num_threads(), "variants": summary}
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    print(markdown(summary, positions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
