"""Batch evaluation through the public Python API: ``ldqa eval BENCHMARK --data PATH --modes ... --out DIR``.

Every answer comes from `LongDocQA.answer` (and `LongDocQA.retrieve` for the `retrieval` benchmark); the
reference mode ``hf`` feeds transformers' own ``generate`` (full attention, greedy) exactly the same prompt
ids (`ldqa.app.prompt.build_prompt(...).ids()`), same ``max_new_tokens``, output cut at the first of
`STOP_STRINGS`, so ldqa's accuracy and speed are checked against an independent implementation.

Benchmarks (``--data`` is always a path; nothing is downloaded)
---------------------------------------------------------------
nq-multidoc
    The "Lost in the Middle" protocol (Liu et al. 2023, TACL) on NQ-open: a question with ``--n-passages``
    passages, its gold passage at each of ``--gold-positions`` (1-based; default 1 and every 5th up to
    k, the study's positions). Data: the NQ-open oracle file (``nq-open-oracle.jsonl.gz``). Distractors
    are the gold passages of *other* questions that contain none of the question's normalized answers,
    sampled with a seed (`ldqa.eval.nq.multidoc_example`; the study used retriever results instead).
    Metric: best-subspan EM (SQuAD normalization; a gold answer occurs in the prediction).
kv-retrieval
    The synthetic JSON key-value task of the same study: the JSON object is one passage, the question
    'What is the value of key "K" in the JSON data?', the study's instruction (`KV_INSTRUCTION`) and the
    answer started for the model (`KV_ANSWER_PREFIX`: 'The value of key "K" is "', which the model
    continues with the value); the queried pair is moved to each of ``--depths``
    (percent of the records); ``--kv-keys`` keeps fewer records. Metric: exact match of the value, counted
    as in the study (the value occurs in the answer; best-subspan EM).
niah
    Needle in a haystack over a directory of ``.txt`` files: ``--lengths`` (haystack tokens) x ``--depths``
    (percent), the haystack with the needle inserted given as passages of ``--passage-tokens`` tokens
    (the needle is never split). Needle, question and answers from ``--niah-config`` (JSON with
    ``needle``, ``question``, ``answers``) or our own default (`NIAH_DEFAULT`). Metric: best-subspan EM.
retrieval
    NQ-open oracle: every gold passage becomes one document of a corpus ingested into ``DIR/corpus-*``;
    per question, the rank of its gold document among `retrieve`'s top 10 gives recall@1/5/10, MRR@10
    and nDCG@10 (one relevant document: 1/log2(rank + 1)) per ``--retriever``; the top ``--top-k``
    passages are then answered over (best-subspan EM).
jsonl
    Any JSON-lines file of ``{context | passages, question | input, answers}`` records, LongBench's format
    included (``context, input, answers, all_classes, length, _id``); a ``context`` string is split into
    passages of ``--passage-tokens`` tokens (the whole context, cut in its middle to fit ``--max-length``
    when given). With ``--retriever`` (or a mode item ``full@hybrid``) each record's ``context`` is
    instead ingested as its own collection (ldqa's chunker, embedder and store; cached in
    ``DIR/collections/`` by the context's sha256 and the chunking/embedder settings) and the question
    answered over the top ``--top-k`` chunks by `LongDocQA.ask`, as ``ldqa ask`` would; rows add the
    retrieval time, cold and warm TTFT and whether the retrieved chunks hold a gold answer
    (`answering.answer_from_collection`). ``python -m ldqa.eval.pg_essays`` builds such a file from questions of
    our own over Paul Graham's essays. Metric: token F1, as LongBench's ``qa_f1_score``
    (THUDM/LongBench, ``metrics.py``: SQuAD normalization, then token-level F1, max over the answers).

Modes
-----
``--modes`` is comma-separated over ``full, block, block+recompute, retrieval`` (ldqa's attention modes)
and ``hf``; an item may carry its own debias and retriever as ``ATTENTION[/DEBIAS][@RETRIEVER]``.
Items without them are crossed with ``--debias`` and ``--retriever`` (comma-separated). Debiasing only
applies to full/block/block+recompute (``retrieval`` and ``hf`` run with ``none``); the retriever axis
only to the ``retrieval`` benchmark (default hybrid) and ``jsonl`` (default: none, the whole context;
not with ``hf``).

Outputs in ``--out DIR``
------------------------
``predictions.sqlite`` (one row per example and mode, keyed by (settings hash, benchmark, mode, example
id): a rerun, e.g. after an interruption or with a larger ``--limit``, answers only what is missing),
``results.json`` (settings, per-mode summary, every row), ``results.csv`` (every row), ``summary.md``
(accuracy, TTFT, tokens/s, peak memory per mode) and plots: ``accuracy_vs_position.png`` (nq-multidoc,
kv-retrieval), ``niah_heatmap.png`` (niah), ``ttft_vs_length.png`` (all). Examples are a seeded sample
(the first ``--limit`` of a seeded permutation, so a larger limit extends a smaller one; ``--skip N``
leaves out its first N, to extend a run whose rows are kept elsewhere); decoding is greedy: a run is
deterministic for a seed (timings aside).

On Ray
------
``--ray [ADDRESS]`` answers the missing rows on a pool of Ray actors (``--workers N``,
``--threads-per-worker T``; `ldqa.eval.ray_eval`), each loading the model once and calling `answer_one`
as this process would; examples, retrieval and ``predictions.sqlite`` stay here, so a run with or without
Ray gives the same rows and either resumes the other.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict, fields
from pathlib import Path

from ldqa.app import options
from ldqa.eval.answering import HFReference, answer_one, retrieve_for
# the eval's names, defined by topic (config: the run and its modes; examples: the benchmarks' examples;
# prediction_cache: what an answer is cached under; report: summaries, tables, plots), importable from here
from ldqa.eval.config import (BENCHMARKS, DEBIAS_METHODS, DEFAULT_MAX_NEW, ENGINES, METRIC, RETRIEVERS,  # noqa: F401
                              EvalConfig, Mode, _validate, gold_positions, parse_modes)
from ldqa.eval.examples import BUILDERS, KV_ANSWER_PREFIX, KV_INSTRUCTION, _kv, _sample  # noqa: F401
from ldqa.eval.prediction_cache import PredictionCache, mode_cache_key, settings_hash
from ldqa.eval.report import _median, summarize, summary_markdown, write_outputs  # noqa: F401


def run(cfg: EvalConfig) -> dict:
    """Evaluate every mode on the benchmark's examples; write results, summary and plots to `cfg.out`.

    Returns the results dict (also ``results.json``) with ``computed`` and ``cached`` row counts, and
    ``errors``: answers that failed (the model's logits turned NaN/inf), kept in ``rows`` with their
    ``error`` and counted per mode, but left out of the summaries and not cached.

    Raises
    ------
    ValueError naming the bad argument: unknown benchmark, mode, debias method or retriever, missing
    --data, out-of-range numbers.
    """
    import torch

    from ldqa.app.api import LongDocQA

    modes = _validate(cfg)
    out = Path(cfg.out or f"out/eval-{cfg.benchmark}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    max_new = cfg.max_new_tokens or DEFAULT_MAX_NEW[cfg.benchmark]
    if cfg.benchmark == "retrieval":  # one corpus store per data file
        store = out / f"corpus-{hashlib.sha256(str(Path(cfg.data).resolve()).encode()).hexdigest()[:10]}" / "store"
    else:
        store = out / "store"
    qa = LongDocQA(store=store, model=cfg.model, max_new_tokens=max_new, weights=cfg.weights,
                   chat_template=cfg.chat_template, device=cfg.device, kv_dtype=cfg.kv_dtype)
    config = settings_hash(cfg, qa.llm.fingerprint, max_new, qa.chat_format(), qa.device, qa.kv_dtype)
    examples = BUILDERS[cfg.benchmark](cfg, qa)
    cache = PredictionCache(out / "predictions.sqlite")
    rows: dict[tuple, dict] = {}
    todo = []
    for ex in examples:
        for m in modes:
            hit = cache.get(config, cfg.benchmark, mode_cache_key(m, cfg=cfg), ex["id"])
            if hit is not None:
                rows[(ex["id"], m)] = hit
            else:
                todo.append((ex, m))
    n_cached = len(rows)
    if n_cached:
        print(f"ldqa eval: answers from the cache: {n_cached}, in {out / 'predictions.sqlite'}", file=sys.stderr)
    ray_info: dict = {}
    answered = _answers_here(qa, cfg, todo, max_new) if cfg.ray is None or not todo else \
        _answers_on_ray(cfg, qa, todo, max_new, ray_info)
    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc=f"eval {cfg.benchmark}" + (" on Ray" if cfg.ray else ""), unit="answer",
               file=sys.stderr, disable=not cfg.progress)
    errors: list[dict] = []  # rows whose answer failed (see answer_one): recorded, left out of the accuracy
    try:
        for ex, m, row in answered:
            if row.get("error"):  # not cached: a rerun (other weights, a fixed model) answers it again
                errors.append(row)
                if len(errors) == 1:
                    print(f"\nldqa eval: {m.label} on {ex['id']}: error: {row['error']}", file=sys.stderr)
            else:
                row["created_at"] = cache.put(config, cfg.benchmark, mode_cache_key(m, cfg=cfg), ex["id"], row)
            rows[(ex["id"], m)] = row
            bar.update(1)
    except KeyboardInterrupt:
        print(f"\nldqa eval: interrupted; {len(rows)} answers are saved, run the same command to resume",
              file=sys.stderr)
        raise
    finally:
        answered.close()  # a Ray pool stops here
        bar.close()
        cache.close()
    ordered = [rows[(ex["id"], m)] for ex in examples for m in modes]
    scored = [r for r in ordered if not r.get("error")]
    result = {"benchmark": cfg.benchmark, "metric": METRIC[cfg.benchmark], "model": qa.model_name,
              "settings": asdict(cfg) | {"max_new_tokens": max_new, "settings_hash": config, "weights": qa.weights,
                                         "device": qa.device, "kv_dtype": qa.kv_dtype,
                                         "chat_template": "model" if qa.chat_format() else "none"},
              "modes": [summarize([r for r in scored if r["mode"] == m.label], cfg.benchmark)
                        | {"mode": m.label, "errors": sum(r["mode"] == m.label for r in errors)} for m in modes],
              "computed": len(todo), "cached": n_cached, "errors": len(errors), "rows": ordered}
    if ray_info:
        result["ray"] = ray_info
    if errors:
        print(f"ldqa eval: {len(errors)} of {len(todo)} answers failed (the first error is above); they are "
              f"in results.json/results.csv with their 'error', not scored and not cached", file=sys.stderr)
    write_outputs(result, out)
    return result


def _answers_here(qa, cfg: EvalConfig, todo: list, max_new: int):
    """(example, mode, row) for each of `todo`, answered in this process, in order."""
    hf = HFReference(qa.llm) if any(m.attention == "hf" for _, m in todo) else None
    for ex, m in todo:
        yield ex, m, answer_one(qa, hf, cfg, ex, m, max_new)


def _answers_on_ray(cfg: EvalConfig, qa, todo: list, max_new: int, info: dict):
    """(example, mode, row) for each of `todo`, answered by Ray workers as they finish
    (`ldqa.eval.ray_eval.eval_rows`, retrieving here with `retrieve_for`; fills `info`)."""
    from ldqa.eval.ray_eval import eval_rows

    yield from eval_rows(cfg, qa, todo, max_new, info, retrieve_for)


def add_arguments(p) -> None:
    """The options of ``ldqa eval`` on argparse parser `p`."""
    p.add_argument("benchmark", help=f"one of {', '.join(BENCHMARKS)}")
    p.add_argument("--data", required=True,
                   help="data file (NQ-open oracle .jsonl.gz, kv-retrieval .jsonl.gz, any .jsonl) or, for niah, "
                        "a directory of .txt files")
    p.add_argument("--modes", default="full",
                   help=f"comma-separated: {', '.join(ENGINES)}; an item may be ATTENTION[/DEBIAS][@RETRIEVER]")
    p.add_argument("--debias", default="none", help=f"comma-separated: {', '.join(DEBIAS_METHODS)}")
    p.add_argument("--retriever", default=None,
                   help=f"comma-separated: {', '.join(RETRIEVERS)}. retrieval benchmark: default hybrid. jsonl: each "
                        "record's context becomes its own collection (ldqa's chunker, embedder and store, cached "
                        "under OUT/collections) and is answered over the top --top-k chunks as `ldqa ask` would; "
                        "default: the whole context")
    p.add_argument("--limit", type=int, default=None, help="questions (niah: grid cells) evaluated; default all")
    p.add_argument("--skip", type=int, default=0,
                   help="leave out the first SKIP of those (questions SKIP..LIMIT-1 of the seeded order); default 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default out/eval-BENCHMARK)")
    options.add_model_arguments(p, weights_note="The hf mode runs transformers in fp32: compare it with --weights "
                                                "fp32 for exact parity.")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer cap (default: per benchmark)")
    p.add_argument("--n-passages", type=int, default=10, help="nq-multidoc: passages per question")
    p.add_argument("--gold-positions", default="default",
                   help="nq-multidoc: 1-based positions, 'all', or 'default' (1 and every 5th)")
    p.add_argument("--depths", default="0,25,50,75,100", help="kv-retrieval, niah: depths in percent")
    p.add_argument("--lengths", default="1024,2048,4096", help="niah: haystack lengths in tokens")
    p.add_argument("--kv-keys", type=int, default=None, help="kv-retrieval: keep this many key-value records")
    p.add_argument("--top-k", type=int, default=5,
                   help="retrieval, jsonl with --retriever: passages retrieved and answered over (>= 1)")
    p.add_argument("--passage-tokens", type=int, default=512, help="niah, jsonl: tokens per passage of a long text")
    p.add_argument("--niah-config", default=None, help="niah: JSON with needle, question, answers")
    p.add_argument("--recompute-ratio", type=float, default=None, help=options.knob("recompute_ratio").help)
    p.add_argument("--recompute-select", choices=[*options.knob("recompute_select").choices, "oracle"], default=None,
                   help=options.knob("recompute_select").help + "; oracle: nq-multidoc's gold passage, whole, for "
                        "diagnostics")
    p.add_argument("--block-anchors", action="store_true",
                   help=options.knob("block_anchors").help + " (jsonl with --retriever: the chunks of each record's "
                        "collection)")
    p.add_argument("--anchor-passages", type=int, default=None, choices=range(0, options.knob("anchor_passages").high + 1),
                   metavar="N", help=options.knob("anchor_passages").help)
    p.add_argument("--debias-strength", type=float, default=None, help=options.knob("debias_strength").help)
    p.add_argument("--max-length", type=int, default=None,
                   help="jsonl: cut each context's middle (LongBench) so prompt + answer budget fit this many tokens")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="jsonl with --retriever: chunk size of each record's collection, in LLM tokens (default 256)")
    p.add_argument("--overlap-tokens", type=int, default=None,
                   help="jsonl with --retriever: overlap between chunks, in LLM tokens (default 32)")
    p.add_argument("--abstain-below", type=float, default=None,
                   help="jsonl with --retriever: answer 'Not found in the documents.' without the model when no "
                        "retrieved chunk reaches this dense cosine similarity, as `ldqa ask` (default 0.25; 0 "
                        "turns it off)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    from ldqa.app.ray_workers import add_arguments as add_ray_arguments

    add_ray_arguments(p)


def config_from_args(args) -> EvalConfig:
    return EvalConfig(**{f.name: getattr(args, f.name) for f in fields(EvalConfig)})


def main_from_args(args) -> int:
    """``ldqa eval``: run and print the summary table."""
    result = run(config_from_args(args))
    print(summary_markdown(result), end="")
    return 0
