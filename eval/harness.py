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
(the first ``--limit`` of a seeded permutation, so a larger limit extends a smaller one); decoding is
greedy: a run is deterministic for a seed (timings aside).

On Ray
------
``--ray [ADDRESS]`` answers the missing rows on a pool of Ray actors (``--workers N``,
``--threads-per-worker T``; `ldqa.eval.ray_eval`), each loading the model once and calling `answer_one`
as this process would; examples, retrieval and ``predictions.sqlite`` stay here, so a run with or without
Ray gives the same rows and either resumes the other.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ldqa.app import options
from ldqa.eval.answering import RANK_KS, HFReference, answer_one, collection_settings, retrieve_for, write_context

BENCHMARKS = ("nq-multidoc", "kv-retrieval", "niah", "retrieval", "jsonl")
# the allowed values of `AnswerOptions` (ldqa.app.options), and the transformers reference "hf"
ENGINES = options.knob("attention").choices + ("hf",)
DEBIAS_METHODS = options.knob("debias").choices
RETRIEVERS = options.knob("retriever").choices
NIAH_DEFAULT = {"needle": "The secret ingredient of the Korvel kiln glaze is smoked paprika.",
                "question": "What is the secret ingredient of the Korvel kiln glaze?", "answers": ["paprika"]}
DEFAULT_MAX_NEW = {"nq-multidoc": 32, "kv-retrieval": 48, "niah": 16, "retrieval": 32, "jsonl": 64}
METRIC = {"nq-multidoc": "best-subspan EM", "kv-retrieval": "value exact match (best-subspan)",
          "niah": "needle found (best-subspan EM)", "retrieval": "best-subspan EM",
          "jsonl": "token F1 (LongBench qa_f1_score)"}
RETRIEVER_BENCHMARKS = ("retrieval", "jsonl")  # where a mode's retriever means something (`parse_modes`)
# summary columns of jsonl modes answered over per-record collections (`answering.answer_from_collection`)
JSONL_COLLECTION_COLUMNS = ["gold_in_retrieved", "retrieval_ms", "ttft_cold_ms", "ttft_warm_ms", "abstained"]


@dataclass
class EvalConfig:
    """Settings of one `run` (the options of ``ldqa eval``; see the module docstring).

    Parameters
    ----------
    benchmark : one of `BENCHMARKS`.
    data : the data file (directory of .txt files for niah).
    out : output directory (results, plots, the prediction cache).
    modes, debias, retriever : comma-separated mode items, crossed (see `parse_modes`). retriever None
        (not given): "hybrid" for the retrieval benchmark; for jsonl the whole-context path (a retriever
        there answers each record over its own collection, see `answering.answer_from_collection`).
    limit : number of questions (nq-multidoc, kv-retrieval, retrieval, jsonl; each at every position or
        depth) or of (length, depth) cells (niah); None = all.
    seed : seeds the example sample, the distractors and torch.
    model : LLM name or path (`LongDocQA`'s default when None).
    weights : the LLM's weight format (`LongDocQA`'s default when None); part of the model fingerprint,
        so each format's answers are cached apart.
    max_new_tokens : answer cap; None = the benchmark's default (`DEFAULT_MAX_NEW`).
    top_k : retrieval, and jsonl with a retriever: passages retrieved and answered over.
    max_length : jsonl: a record's ``context`` is cut in its middle (LongBench's truncation, pred.py: the
        first and last halves kept) until the built prompt plus the answer budget is at most this many
        tokens; the row logs ``context_tokens_cut`` and its final ``prompt_tokens``. None = no cut (the
        API still leaves out the last passages that do not fit the model's window).
    ray : None (answer in this process), "local" (a new local Ray instance) or a Ray address ("auto",
        "ray://host:10001"): the missing answers are computed by a pool of Ray actors
        (`ldqa.eval.ray_eval`), the same rows as without Ray; this process retrieves (retrieval
        benchmark) and writes the cache. Needs the ``ray`` extra.
    workers : Ray actors (None: one per CPU slot Ray reports, divided by threads_per_worker).
    threads_per_worker : torch threads (and Ray CPUs) of each actor.
    chunk_tokens, overlap_tokens : jsonl with a retriever: the chunking of each record's collection, in
        LLM tokens (None: `LongDocQA`'s defaults, 256 and 32).
    abstain_below : jsonl with a retriever: `ask`'s abstention threshold (dense cosine; 0 turns it off;
        None: ldqa's default `ABSTAIN_BELOW`).
    chat_template : "auto" (an instruct model is prompted through its chat template) or "none" (`LongDocQA`);
        with a template, its rendered text is part of `settings_hash`.
    recompute_ratio, recompute_select : block+recompute's share of recomputed passage tokens and how they
        are chosen (`block_attention.SELECT_METHODS`, or "oracle": nq-multidoc's gold passage whole);
        None = the defaults.
    block_anchors : block modes encode a chunk of a long document after its document's first chunk
        (jsonl with a retriever: the chunks of a record's collection).
    device, kv_dtype : where the LLM runs and its KV cache's dtype (`LongDocQA`'s; None: the device's
        default); unless cpu and fp32, both are part of `settings_hash`.
    """

    benchmark: str
    data: str
    out: str | None = None
    modes: str = "full"
    debias: str = "none"
    retriever: str | None = None
    limit: int | None = None
    seed: int = 0
    model: str | None = None
    weights: str | None = None
    max_new_tokens: int | None = None
    n_passages: int = 10
    gold_positions: str = "default"
    depths: str = "0,25,50,75,100"
    lengths: str = "1024,2048,4096"
    kv_keys: int | None = None
    top_k: int = 5
    passage_tokens: int = 512
    niah_config: str | None = None
    recompute_ratio: float | None = None
    recompute_select: str | None = None
    block_anchors: bool = False
    progress: bool = True
    max_length: int | None = None
    ray: str | None = None
    workers: int | None = None
    threads_per_worker: int = 1
    chunk_tokens: int | None = None
    overlap_tokens: int | None = None
    abstain_below: float | None = None
    chat_template: str = "auto"
    device: str = "auto"
    kv_dtype: str | None = None


@dataclass(frozen=True)
class Mode:
    """One evaluated configuration: `attention` (an ldqa attention mode or "hf"), `debias`, `retriever`
    (None outside the retrieval and jsonl benchmarks, and for jsonl's whole-context path); `collection`:
    each example is answered over its own collection (jsonl with a retriever, `answer_from_collection`)."""

    attention: str
    debias: str = "none"
    retriever: str | None = None
    collection: bool = False

    @property
    def label(self) -> str:
        """Short display name, e.g. "block+recompute/calibrate@bm25" (defaults left out)."""
        s = self.attention + ("" if self.debias == "none" else f"/{self.debias}")
        return s + (f"@{self.retriever}" if self.retriever else "")

    @property
    def key(self) -> str:
        """Cache key: every axis spelled out."""
        return f"{self.attention}/{self.debias}@{self.retriever or '-'}"


# ------------------------------------------------------------------------------------ argument parsing

def _csv(value: str, name: str) -> list[str]:
    items = [x.strip() for x in str(value).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{name} is empty: give a comma-separated list")
    return items


def _ints(value: str, name: str) -> list[int]:
    try:
        return [int(x) for x in _csv(value, name)]
    except ValueError as e:
        raise ValueError(f"{name}={value!r}: expected comma-separated integers") from e


def parse_modes(modes: str, debias: str = "none", retriever: str | None = "hybrid",
                benchmark: str = "") -> list[Mode]:
    """The cross product of mode items x debias methods x retrievers, duplicates removed, in order.

    Parameters
    ----------
    modes : comma-separated items ``ATTENTION[/DEBIAS][@RETRIEVER]``, ATTENTION in `ENGINES`.
    debias, retriever : comma-separated defaults for items that do not name their own; retriever None
        (not given): "hybrid" for the retrieval benchmark, none for jsonl (the whole context).
    benchmark : the retriever axis only exists for "retrieval" and "jsonl" (`RETRIEVER_BENCHMARKS`).

    Raises
    ------
    ValueError naming --modes, --debias or --retriever for an unknown value, a debias method given
    with the retrieval/hf modes, or hf with a retriever on jsonl.
    """
    debiases = _csv(debias, "--debias")
    retrievers = _csv(retriever, "--retriever") if retriever is not None else [None]
    out: list[Mode] = []
    for item in _csv(modes, "--modes"):
        rest, _, own_r = item.partition("@")
        att, _, own_d = rest.partition("/")
        if att not in ENGINES:
            raise ValueError(f"--modes: unknown mode {att!r}; choose from {', '.join(ENGINES)}")
        ds = [own_d] if own_d else debiases
        rs = [own_r] if own_r else retrievers
        for d in ds:
            if d not in DEBIAS_METHODS:
                raise ValueError(f"--debias: unknown method {d!r}; choose from {', '.join(DEBIAS_METHODS)}")
            if d != "none" and not _debias_applies(att, d):
                if own_d:
                    raise ValueError(f"--modes {item!r}: debiasing does not apply to the {att} mode"
                                     + (" (buckets needs full attention)" if d == "buckets" else ""))
                d = "none"  # the debias axis collapses for modes it does not apply to
            for r in rs:
                if r is None and benchmark == "retrieval":
                    r = "hybrid"
                if r is not None and r not in RETRIEVERS:
                    raise ValueError(f"--retriever: unknown retriever {r!r}; choose from {', '.join(RETRIEVERS)}")
                keep = r if benchmark in RETRIEVER_BENCHMARKS else None
                m = Mode(att, d, keep, collection=benchmark == "jsonl" and keep is not None)
                if m.collection and att == "hf":
                    raise ValueError("--modes hf: the transformers reference answers over given passages, not "
                                     "over a collection; with --retriever on jsonl use ldqa's attention modes "
                                     "(full, block, ...)")
                if m not in out:
                    out.append(m)
    return out


def _debias_applies(attention: str, debias: str) -> bool:
    """Whether debias method `debias` runs with `attention` (the rule of `AttentionConfig.resolved`; the
    HF reference has no debiasing)."""
    if attention == "hf":
        return False
    from ldqa.attention.debias import DebiasConfig
    from ldqa.attention.engine import AttentionConfig

    try:
        AttentionConfig(attention, debias=DebiasConfig(debias)).resolved()
    except ValueError:
        return False
    return True


def gold_positions(spec: str, n_passages: int) -> list[int]:
    """1-based gold positions: "default" = 1 and every 5th up to n (the study's), "all", or a list."""
    if spec == "default":
        return sorted({1, n_passages, *range(5, n_passages + 1, 5)})
    pos = list(range(1, n_passages + 1)) if spec == "all" else _ints(spec, "--gold-positions")
    bad = [p for p in pos if not 1 <= p <= n_passages]
    if bad:
        raise ValueError(f"--gold-positions {bad} outside 1..{n_passages} (--n-passages)")
    return pos


def _validate(cfg: EvalConfig) -> list[Mode]:
    if cfg.benchmark not in BENCHMARKS:
        raise ValueError(f"benchmark {cfg.benchmark!r} is unknown; choose from {', '.join(BENCHMARKS)}")
    if not cfg.data or not Path(cfg.data).exists():
        raise ValueError(f"--data {cfg.data}: not found; pass the {cfg.benchmark} data file"
                         + (" (a directory of .txt files)" if cfg.benchmark == "niah" else ""))
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {cfg.limit}")
    for name in ("n_passages", "top_k", "passage_tokens", "kv_keys", "max_new_tokens", "max_length"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.niah_config and not Path(cfg.niah_config).exists():
        raise ValueError(f"--niah-config {cfg.niah_config}: not found")
    if any(not 0 <= d <= 100 for d in _ints(cfg.depths, "--depths")):
        raise ValueError(f"--depths {cfg.depths}: percentages must be in 0..100")
    _ints(cfg.lengths, "--lengths")
    gold_positions(cfg.gold_positions, cfg.n_passages)
    if cfg.recompute_select == "oracle" and cfg.benchmark != "nq-multidoc":
        raise ValueError("--recompute-select oracle needs the gold passage's position: use it with nq-multidoc")
    from ldqa.app.ray_workers import check_options

    check_options(cfg.ray, cfg.workers, cfg.threads_per_worker)
    modes = parse_modes(cfg.modes, cfg.debias, cfg.retriever, cfg.benchmark)
    given = [n for n in ("chunk_tokens", "overlap_tokens", "abstain_below") if getattr(cfg, n) is not None]
    if given and not any(m.collection for m in modes):
        raise ValueError(f"--{given[0].replace('_', '-')} applies to jsonl answered over per-record collections: "
                         "add --retriever hybrid (or dense, bm25)")
    st = collection_settings(cfg)
    if st["chunk_tokens"] < 1 or not 0 <= st["overlap_tokens"] < st["chunk_tokens"]:
        raise ValueError(f"--chunk-tokens {st['chunk_tokens']} / --overlap-tokens {st['overlap_tokens']}: need "
                         "chunk tokens >= 1 and 0 <= overlap < chunk tokens")
    low, high = options.bounds("abstain_below")
    if not low <= st["abstain_below"] <= high:
        raise ValueError(f"--abstain-below {st['abstain_below']}: a cosine similarity, in {low}..{high} (0 turns it "
                         "off)")
    options.check("recompute_ratio", cfg.recompute_ratio)
    return modes


# ------------------------------------------------------------------------------------------ examples

def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _sample(n: int, cfg: EvalConfig) -> list[int]:
    """The first `limit` of a seeded permutation of range(n): a larger limit extends a smaller one."""
    order = list(range(n))
    random.Random(cfg.seed).shuffle(order)
    return order[: cfg.limit] if cfg.limit else order


def split_tokens(tok, ids: list[int], size: int, keep: tuple[int, int] = (0, 0)) -> list[str]:
    """Decode `ids` as texts of about `size` tokens; no boundary falls inside the span `keep`."""
    cuts = [keep[1] if keep[0] < b < keep[1] else b for b in range(size, len(ids), size)]
    cuts = sorted({c for c in cuts if 0 < c < len(ids)})
    texts = [tok.decode(ids[a:b]) for a, b in zip([0] + cuts, cuts + [len(ids)])]
    return [t for t in texts if t.strip()]


def _nq_multidoc(cfg: EvalConfig, qa) -> list[dict]:
    from ldqa.eval.nq import load_nq, multidoc_example

    records = load_nq(Path(cfg.data))
    if cfg.n_passages > len(records):
        raise ValueError(f"--n-passages {cfg.n_passages} exceeds the {len(records)} records of {cfg.data}")
    out = []
    for i in _sample(len(records), cfg):
        for p in gold_positions(cfg.gold_positions, cfg.n_passages):
            ex = multidoc_example(records, i, cfg.n_passages, p, cfg.seed)
            out.append(ex | {"id": f"q{i}/pos{p}", "record": i})
    return out


# The key-value task's instruction, as in Liu et al. 2023 (section 3.1), and the start of the answer: the
# study's prompt ends in 'Corresponding value: "', so the model's first token is the value's; with ldqa's
# QA prompt alone ('Question: ...\nAnswer:') Gemma 3 270M (base) answers 'The value of key "..." in the
# JSON data is 1.' every time (0 of 100, see docs/results.md), which measures nothing.
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
KV_ANSWER_PREFIX = 'The value of key "{key}" is "'


def _kv(cfg: EvalConfig, qa) -> list[dict]:
    rows = _read_jsonl(Path(cfg.data))
    out = []
    for i in _sample(len(rows), cfg):
        r = rows[i]
        others = [tuple(p) for p in r["ordered_kv_records"] if p[0] != r["key"]]
        if cfg.kv_keys:
            others = others[: max(0, cfg.kv_keys - 1)]
        for d in _ints(cfg.depths, "--depths"):
            pos = round(d / 100 * len(others))
            recs = others[:pos] + [(r["key"], r["value"])] + others[pos:]
            data = "{" + ", ".join(f'"{k}": "{v}"' for k, v in recs) + "}"
            out.append({"id": f"{i}/depth{d}", "record": i, "depth": d, "position": pos + 1,
                        "n_records": len(recs), "question": f'What is the value of key "{r["key"]}" in the JSON data?',
                        "answers": [r["value"]], "passages": [{"title": "JSON data", "text": data}],
                        "instruction": KV_INSTRUCTION, "answer_prefix": KV_ANSWER_PREFIX.format(key=r["key"])})
    return out


def _haystack(path: Path, tok, n_tokens: int) -> list[int]:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"--data {path}: no .txt files for the niah haystack")
    text = ""
    for f in files:  # read only what the longest context needs (about 4 characters a token; margin 2x)
        text += f.read_text(encoding="utf-8", errors="replace") + "\n\n"
        if len(text) > 8 * n_tokens:
            break
    ids = tok.encode(text)
    if len(ids) < n_tokens:
        raise ValueError(f"--lengths {n_tokens}: the haystack in {path} has only {len(ids)} tokens")
    return ids


def _niah(cfg: EvalConfig, qa) -> list[dict]:
    conf = dict(NIAH_DEFAULT)
    if cfg.niah_config:
        conf |= json.loads(Path(cfg.niah_config).read_text())
    answers = conf.get("answers") or [conf["answer"]]
    tok = qa.llm.tokenizer
    lengths, depths = _ints(cfg.lengths, "--lengths"), _ints(cfg.depths, "--depths")
    hay_ids = _haystack(Path(cfg.data), tok, max(lengths))
    needle = tok.encode(" " + conf["needle"].strip() + " ")
    cells = [(n, d) for n in lengths for d in depths][: cfg.limit]
    out = []
    for n, d in cells:
        hay = hay_ids[: max(0, n - len(needle))]
        at = round(d / 100 * len(hay))
        ids = hay[:at] + needle + hay[at:]
        texts = split_tokens(tok, ids, cfg.passage_tokens, keep=(at, at + len(needle)))
        out.append({"id": f"len{n}/depth{d}", "length": n, "depth": d, "question": conf["question"],
                    "answers": answers, "passages": [{"title": "Essays", "text": t} for t in texts]})
    return out


def _jsonl(cfg: EvalConfig, qa) -> list[dict]:
    """The jsonl benchmark's examples. For modes without a retriever (the whole-context path) a
    ``context`` is split into passages of --passage-tokens (cut in its middle to fit --max-length when
    given); for modes with one (`answering.answer_from_collection`) the context is written to its collection
    directory (`write_context`) and the example carries its ``context_sha256``. Raises ValueError naming
    the record when it lacks a question or answers, or, with a retriever, a ``context`` string."""
    modes = parse_modes(cfg.modes, cfg.debias, cfg.retriever, cfg.benchmark)
    whole, collections = any(not m.collection for m in modes), any(m.collection for m in modes)
    rows = _read_jsonl(Path(cfg.data))
    out = []
    for i in _sample(len(rows), cfg):
        r = rows[i]
        question = r.get("question") or r.get("input")
        answers = r.get("answers") if r.get("answers") is not None else r.get("answer")
        answers = [answers] if isinstance(answers, str) else list(answers or [])
        if not question or not answers:
            raise ValueError(f"--data {cfg.data}, record {i + 1}: needs a question (or input) and answers")
        if collections and not (isinstance(r.get("context"), str) and r["context"].strip()):
            raise ValueError(f"--data {cfg.data}, record {i + 1}: --retriever indexes each record's context, and "
                             "this record has no context string (passages records: drop --retriever)")
        skip, cut, passages = None, 0, None
        if r.get("passages"):
            passages = [p if isinstance(p, dict) else {"title": f"Passage {j + 1}", "text": p}
                        for j, p in enumerate(r["passages"])]
        elif r.get("context"):
            if whole:
                tok = qa.llm.tokenizer
                texts, cut = split_tokens(tok, tok.encode(r["context"]), cfg.passage_tokens), 0
                if cfg.max_length is not None:
                    try:
                        texts, cut = fit_context(tok, r["context"], question, cfg.passage_tokens,
                                                 cfg.max_length - (cfg.max_new_tokens or DEFAULT_MAX_NEW["jsonl"]),
                                                 qa.chat_format())
                    except ValueError as e:  # this record's question cannot fit: an error row, the rest go on
                        skip = str(e)
                passages = [{"title": "Context", "text": t} for t in texts]
        else:
            raise ValueError(f"--data {cfg.data}, record {i + 1}: needs context or passages")
        ex_id = str(r.get("_id") or r.get("id") or f"line{i + 1}")
        out.append({"id": ex_id, "record": i, "question": question, "answers": answers, "passages": passages,
                    **({"length": r["length"]} if "length" in r else {}),
                    **({"context_tokens_cut": cut} if cfg.max_length is not None and whole else {}),
                    **({"skip_reason": skip} if skip else {}),
                    **({"context_sha256": write_context(qa, r["context"], cfg)} if collections else {})})
    return out


def fit_context(tok, context: str, question: str, passage_tokens: int, budget: int,
                chat=None) -> tuple[list[str], int]:
    """Passages of a long `context` whose prompt (`build_prompt`, default instruction, the model's `chat`
    format or None) is at most `budget` tokens, cutting the context's middle as LongBench does
    (`prompt.truncate_middle`). Returns (passage texts, context tokens cut). Raises ValueError when even an
    empty context does not fit `budget`."""
    from types import SimpleNamespace

    from ldqa.app.prompt import build_prompt, truncate_middle

    ids = tok.encode(context)
    n_ctx = len(ids)
    base = len(build_prompt(tok, [], question, chat=chat).ids())  # instruction + question, no passage
    if base >= budget:
        raise ValueError(f"--max-length: the question alone takes {base} prompt tokens, over the budget of "
                         f"{budget} (max length minus the answer budget); raise --max-length")
    for _ in range(8):  # decoding and re-encoding the pieces may shift the count by a few tokens
        texts = split_tokens(tok, ids, passage_tokens)
        n = len(build_prompt(tok, [SimpleNamespace(title="Context", text=t, page=None) for t in texts],
                             question, chat=chat).ids())
        if n <= budget:
            return texts, n_ctx - len(ids)
        frame = max(0.0, (n - base - len(ids)) / max(1, len(texts)))  # tokens each piece's framing adds
        keep = int((budget - base) / (1 + frame / passage_tokens) - frame) - 1
        keep = min(keep, len(ids) - 1)
        if keep < 2:
            raise ValueError(f"--max-length: the question leaves {budget - base} prompt tokens, too few for "
                             f"any of the context; raise --max-length")
        ids = truncate_middle(ids, keep)
    raise ValueError(f"--max-length: could not fit the context into {budget} prompt tokens")


def _retrieval(cfg: EvalConfig, qa) -> list[dict]:
    from ldqa.eval.nq import load_nq

    records = load_nq(Path(cfg.data))
    folder = qa.store.path.parent / "passages"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, r in enumerate(records):  # one Markdown document per gold passage (as eval/bench/bench_nq.py)
        p = folder / f"{i:05d}.md"
        body = f"# {r['title']}\n\n{r['text']}\n"
        if not p.exists() or p.read_text(encoding="utf-8") != body:
            p.write_text(body, encoding="utf-8")
        paths.append(p)
    report = qa.ingest(paths, progress=cfg.progress)  # unchanged files are skipped on a rerun
    doc_of = [f.doc_id for f in report.files]  # duplicates carry the stored copy's id
    return [{"id": f"q{i}", "record": i, "question": records[i]["question"], "answers": records[i]["answers"],
             "gold_doc": doc_of[i], "passages": None} for i in _sample(len(records), cfg)]


BUILDERS = {"nq-multidoc": _nq_multidoc, "kv-retrieval": _kv, "niah": _niah, "retrieval": _retrieval,
            "jsonl": _jsonl}


# ------------------------------------------------------------------------------------------ the cache

class PredictionCache:
    """Per-example rows in SQLite (``DIR/predictions.sqlite``), keyed by (settings hash, benchmark, mode
    key, example id); each row is committed as soon as it is answered, so an interrupted run resumes."""

    def __init__(self, path: Path):
        import sqlite3

        self.db = sqlite3.connect(str(path))
        self.db.execute("CREATE TABLE IF NOT EXISTS predictions (config TEXT, benchmark TEXT, mode TEXT, "
                        "example_id TEXT, row TEXT, created_at REAL, "
                        "PRIMARY KEY (config, benchmark, mode, example_id))")

    def get(self, config: str, benchmark: str, mode: str, example_id: str) -> dict | None:
        r = self.db.execute("SELECT row, created_at FROM predictions WHERE config=? AND benchmark=? AND mode=? "
                            "AND example_id=?", (config, benchmark, mode, example_id)).fetchone()
        return json.loads(r[0]) | {"created_at": r[1]} if r else None

    def put(self, config: str, benchmark: str, mode: str, example_id: str, row: dict) -> float:
        now = time.time()
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO predictions VALUES (?, ?, ?, ?, ?, ?)",
                            (config, benchmark, mode, example_id, json.dumps(row), now))
        return now

    def close(self) -> None:
        self.db.close()


def settings_hash(cfg: EvalConfig, fingerprint: str, max_new: int, chat=None, device: str = "cpu",
                  kv_dtype: str = "fp32") -> str:
    """Hash of everything besides the mode and example id that changes a prediction (data, model,
    seed, lengths of answers and contexts, the chat template's text when the model is prompted through
    one: `chat`, a `ChatFormat`; the resolved `device` and `kv_dtype` unless cpu and fp32); --limit,
    --modes and the position lists are left out."""
    data = Path(cfg.data).resolve()
    size = data.stat().st_size if data.is_file() else sorted((p.name, p.stat().st_size) for p in data.glob("*.txt"))
    niah = Path(cfg.niah_config).read_text() if cfg.niah_config else ""
    key = [cfg.benchmark, str(data), size, cfg.model, fingerprint, max_new, cfg.seed, cfg.n_passages, cfg.kv_keys,
           cfg.top_k, cfg.passage_tokens, niah, cfg.recompute_ratio]
    if cfg.benchmark == "kv-retrieval":  # the task's own prompt (added after the first kv runs: new hash)
        key.append([KV_INSTRUCTION, KV_ANSWER_PREFIX])
    if cfg.max_length is not None:  # (unset keeps the hashes of runs without it)
        key.append(["max_length", cfg.max_length])
    if chat is not None:  # base-model prompts keep their hashes
        key.append(["chat", chat.opening + chat.lead, chat.closing, list(chat.stop_ids), list(chat.stop_strings)])
    if device != "cpu" or kv_dtype != "fp32":  # (the CPU's fp32 cache keeps the hashes of runs before devices)
        key.append(["device", device.split(":")[0], kv_dtype])
    return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:16]


def mode_cache_key(m: Mode, retrieval_config=None, cfg: EvalConfig | None = None) -> str:
    """The cache key of mode `m`: `Mode.key`, and a hash of the settings its resolved `AttentionConfig`
    runs with where they have defaults that may change: for attention "retrieval" its `RetrievalConfig`
    (`RetrievalConfig()` unless given), for the calibrate methods their measurement orders, calibration
    form and strength. A changed default (e.g. `top_k_keys`) thus recomputes those answers instead of
    reading stale ones. The hashed dicts are built field by field here, not from `AttentionConfig`
    itself, so existing caches keep their keys (tests/test_cache_keys.py). A jsonl mode answered over per-record
    collections (`Mode.collection`) adds ``+collection#`` and a hash of `collection_settings(cfg)`
    (chunking, embedder, abstention threshold): its retriever is already in `Mode.key`, --top-k in
    `settings_hash`."""
    key = _attention_key(m, retrieval_config, cfg.recompute_select if cfg is not None else None,
                         cfg.recompute_ratio if cfg is not None else None)
    if cfg is not None and cfg.block_anchors and m.attention.startswith("block"):
        key += "+anchors"
    if m.collection:
        st = collection_settings(cfg)
        key += "+collection#" + hashlib.sha256(json.dumps(st, sort_keys=True).encode()).hexdigest()[:12]
    return key


def _attention_key(m: Mode, retrieval_config=None, recompute_select: str | None = None,
                   recompute_ratio: float | None = None) -> str:
    """`mode_cache_key` without the collection part; block+recompute adds its recipe,
    ``+select=NAME@RATIO`` (`recompute_select` and `recompute_ratio`, else the defaults), unless it is
    CacheBlend's deviation at 0.15, the recipe of the keys without a suffix, and with a debias method
    that measures, ``+measured=block`` (where it measures the passages' attention)."""
    if m.attention == "hf":
        return m.key
    from ldqa.attention.engine import AttentionConfig
    from ldqa.attention.debias import DebiasConfig

    cfg = AttentionConfig(m.attention, retrieval=retrieval_config, debias=DebiasConfig(m.debias)).resolved()
    select, ratio = recompute_select or cfg.block.select, cfg.block.recompute_ratio
    if recompute_ratio is not None:
        ratio = recompute_ratio
    plain = m.attention != "block+recompute" or (select == "deviation" and ratio == 0.15)
    key = _debias_or_retrieval_key(m, cfg) + ("" if plain else f"+select={select}@{ratio:g}")
    if m.attention == "block+recompute" and cfg.debias.method in ("calibrate", "calibrate+reorder", "sort"):
        key += "+measured=block"  # the passages ranked on the plain block cache, then one recompute
    return key


def _debias_or_retrieval_key(m: Mode, cfg) -> str:
    d = cfg.debias
    if d.calibrates:
        fields = {"orders": d.orders, "calibration": d.calibration, "strength": d.strength}
    elif cfg.retrieval is not None:
        fields = asdict(cfg.retrieval)
    else:
        return m.key
    return m.key + "#" + hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------------ the run

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
        print(f"ldqa eval: {n_cached} answers from the cache in {out / 'predictions.sqlite'}", file=sys.stderr)
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


# ------------------------------------------------------------------------------------------ results

def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict], benchmark: str) -> dict:
    """One mode's summary: n, accuracy (mean score), median TTFT / tokens/s (tokens/s over answers of
    two tokens or more) / prompt tokens, peak memory, and the benchmark's breakdown."""
    s = {"n": len(rows), "accuracy": _mean(r["score"] for r in rows),
         "ttft_ms": _median(r["ttft_ms"] for r in rows),
         "tokens_per_s": _median(r["tokens_per_s"] for r in rows if r["tokens_per_s"]),
         "prompt_tokens": _median(r["prompt_tokens"] for r in rows),
         "peak_mb": max((r["peak_mb"] for r in rows), default=None),
         "fallbacks": sum(r["attention_used"] != r["mode"].split("/")[0].split("@")[0] for r in rows)}
    if benchmark == "retrieval":
        s |= {k: _mean(r[k] for r in rows) for k in [f"recall@{k}" for k in RANK_KS] + ["mrr@10", "ndcg@10"]}
    if benchmark == "jsonl" and any("gold_in_retrieved" in r for r in rows):  # over per-record collections
        s |= {"gold_in_retrieved": _mean(r["gold_in_retrieved"] for r in rows),
              **{k: _median(r[k] for r in rows) for k in ("retrieval_ms", "ttft_cold_ms", "ttft_warm_ms")},
              "abstained": sum(bool(r.get("abstained")) for r in rows)}
    key = {"nq-multidoc": "gold_position", "kv-retrieval": "depth"}.get(benchmark)
    if key:
        s["by_position"] = {str(p): _mean(r["score"] for r in rows if r[key] == p)
                            for p in sorted({r[key] for r in rows})}
    if benchmark == "niah":
        s["grid"] = {f"{r['length']}@{r['depth']}": r["score"] for r in rows}
    return s


def _fmt(x, digits=1) -> str:
    return "" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def summary_markdown(result: dict) -> str:
    """The summary table (one line per mode) plus, where it applies, accuracy by gold position/depth."""
    bench, modes = result["benchmark"], result["modes"]
    st = result["settings"]
    head = ["mode", "n", "accuracy", "TTFT ms (median)", "tokens/s (median)", "peak RSS MB", "prompt tokens (median)"]
    extra = [f"recall@{k}" for k in RANK_KS] + ["mrr@10", "ndcg@10"] if bench == "retrieval" else []
    if bench == "jsonl" and any("gold_in_retrieved" in m for m in modes):
        extra = JSONL_COLLECTION_COLUMNS
    lines = [f"# ldqa eval {bench}", "",
             f"model `{result['model']}`, data `{st['data']}`, seed {st['seed']}, max_new_tokens "
             f"{st['max_new_tokens']}; accuracy = {result['metric']}; {result['computed']} answers computed, "
             f"{result['cached']} from the cache.", "",
             "| " + " | ".join(head + extra) + " |", "|" + "---|" * len(head + extra)]
    for m in modes:
        cells = [m["mode"], str(m["n"]), _fmt(m["accuracy"], 3), _fmt(m["ttft_ms"]), _fmt(m["tokens_per_s"]),
                 _fmt(m["peak_mb"], 0), _fmt(m["prompt_tokens"], 0)] + [_fmt(m.get(k), 1 if k.endswith("_ms") else 3) for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    if extra == JSONL_COLLECTION_COLUMNS:
        lines += ["", "Modes with a retriever answer each record over its own collection (top "
                  f"{st['top_k']} chunks, as `ldqa ask`): TTFT ms (median) is the cold one, the first question "
                  "over the freshly built collection; ttft_warm_ms the same question again with its KV blocks "
                  "stored; gold_in_retrieved the fraction whose retrieved chunks hold a gold answer."]
    if any(m.get("fallbacks") for m in modes):
        lines += ["", "Some block-mode answers fell back to full attention (see `attention_used` in results.csv)."]
    if "by_position" in modes[0]:
        pos = list(modes[0]["by_position"])
        what = "gold position" if bench == "nq-multidoc" else "key depth %"
        lines += ["", f"Accuracy by {what}:", "", "| mode | " + " | ".join(pos) + " |", "|" + "---|" * (len(pos) + 1)]
        lines += ["| " + m["mode"] + " | " + " | ".join(_fmt(m["by_position"].get(p), 3) for p in pos) + " |"
                  for m in modes]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path) -> None:
    """results.json, results.csv, summary.md and the plots."""
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    cols = list(dict.fromkeys(k for r in result["rows"] for k in r))
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in result["rows"]:
            w.writerow({k: " | ".join(v) if isinstance(v, list) else v for k, v in r.items()})
    (out / "summary.md").write_text(summary_markdown(result))
    plot(result, out)


def plot(result: dict, out: Path) -> list[Path]:
    """ttft_vs_length.png always; accuracy_vs_position.png (nq-multidoc, kv-retrieval); niah_heatmap.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made, modes, rows = [], [m["mode"] for m in result["modes"]], result["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in modes:
        by_len: dict[int, list] = {}
        for r in rows:
            if r["mode"] == m and r["ttft_ms"] is not None:
                by_len.setdefault(r["prompt_tokens"], []).append(r["ttft_ms"])
        xs = sorted(by_len)
        ax.plot(xs, [statistics.median(by_len[x]) for x in xs], "o-", label=m, alpha=0.7)
    ax.set(xlabel="prompt tokens", ylabel="TTFT (ms, median)", title=f"{result['benchmark']}: TTFT vs context length")
    ax.legend(fontsize=7)
    made.append(_save(fig, out / "ttft_vs_length.png"))
    if "by_position" in result["modes"][0]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m in result["modes"]:
            ax.plot([int(p) for p in m["by_position"]], list(m["by_position"].values()), "o-", label=m["mode"])
        xl = "gold passage position" if result["benchmark"] == "nq-multidoc" else "key depth (%)"
        ax.set(xlabel=xl, ylabel="accuracy", ylim=(-0.05, 1.05), title=f"{result['benchmark']}: accuracy vs position")
        ax.legend(fontsize=7)
        made.append(_save(fig, out / "accuracy_vs_position.png"))
    if result["benchmark"] == "niah":
        lengths = sorted({r["length"] for r in rows})
        depths = sorted({r["depth"] for r in rows})
        fig, axes = plt.subplots(1, len(modes), figsize=(3.2 * len(modes) + 1, 3.2), squeeze=False)
        for ax, m in zip(axes[0], result["modes"]):
            grid = [[m["grid"].get(f"{n}@{d}", float("nan")) for n in lengths] for d in depths]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i, line in enumerate(grid):
                for j, v in enumerate(line):
                    ax.text(j, i, "" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
            ax.set(title=m["mode"], xlabel="context tokens", ylabel="needle depth")
        made.append(_save(fig, out / "niah_heatmap.png"))
    return made


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ CLI

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
