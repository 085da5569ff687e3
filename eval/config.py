"""What one `ldqa eval` run is: the benchmarks and their constants, `EvalConfig` (every setting of a run),
`Mode` (one compared configuration) and the checks that turn the command line's lists into modes
(`parse_modes`, `gold_positions`, `_validate`). The benchmarks and the CLI: `ldqa.eval.harness`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ldqa.app import options
from ldqa.eval.answering import collection_settings

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
    skip : the first `skip` of those are left out (questions `skip`..`limit`-1 of the seeded order: a run
        that extends one whose rows are kept elsewhere); 0 = none.
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
    anchor_passages : block modes encode every passage block after this many generic anchor passages
        (None: the mode's default, `block_attention.DEFAULT_ANCHOR_PASSAGES`).
    debias_strength : the calibrate methods' intervention strength (>= 0; None: `debias.STRENGTH` of the
        mode's calibration form); other debias methods ignore it. Part of the calibrate modes' cache keys.
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
    skip: int = 0
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
    anchor_passages: int | None = None
    debias_strength: float | None = None
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
    if cfg.skip < 0 or (cfg.limit is not None and cfg.skip >= cfg.limit):
        raise ValueError(f"--skip must be >= 0 and below --limit, got {cfg.skip}"
                         + (f" with --limit {cfg.limit}" if cfg.limit is not None else ""))
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
    options.check("debias_strength", cfg.debias_strength)
    return modes
