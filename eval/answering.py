"""Answering one benchmark example through the public API: the result row of `ldqa.eval.harness`.

`answer_one` answers an example in one mode (`LongDocQA.answer`, or transformers' own `generate` through
`HFReference`) and scores it; the retrieval benchmark retrieves first (`retrieve_for`); jsonl records with
a retriever are answered over a collection of their own (`answer_from_collection`). The harness calls it
in its own process, and `ldqa.eval.ray_eval`'s workers call it on Ray; neither this module nor the workers
import the harness.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import time
from pathlib import Path

RANK_KS = (1, 5, 10)  # the retrieval benchmark's recall@k cut-offs (`rank_metrics`)


# ------------------------------------------------------------------------------------------ scoring

def rank_metrics(doc_ids: list, gold) -> dict:
    """recall@1/5/10, MRR@10 and nDCG@10 of one question with one relevant document `gold`, from the
    retrieved documents in rank order (repeats of a document, i.e. its other chunks, are dropped)."""
    ranked = list(dict.fromkeys(doc_ids))[:10]
    rank = ranked.index(gold) + 1 if gold in ranked else None
    out = {f"recall@{k}": float(rank is not None and rank <= k) for k in RANK_KS}
    return out | {"gold_rank": rank, "mrr@10": 1 / rank if rank else 0.0,
                  "ndcg@10": 1 / math.log2(rank + 1) if rank else 0.0}


def score(benchmark: str, prediction: str, answers: list[str]) -> float:
    """The benchmark's per-example metric (`harness.METRIC`)."""
    from ldqa.eval.metrics import best_subspan_em, token_f1

    return token_f1(prediction, answers) if benchmark == "jsonl" else best_subspan_em(prediction, answers)


# ------------------------------------------------------------------------------------------ answering

def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakMemory:
    """Peak resident memory (MB) of the process while the block runs, sampled every 10 ms; with CUDA in
    use also the peak allocated GPU memory (`gpu_mb`)."""

    def __enter__(self):
        import torch

        self.peak, self.gpu_mb, self._stop = _rss_mb(), None, threading.Event()
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc):
        import torch

        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())
        if self._cuda:
            self.gpu_mb = torch.cuda.max_memory_allocated() / 2**20


class HFReference:
    """transformers' own `generate` (full attention, greedy) on ldqa's prompt ids: the reference mode."""

    def __init__(self, llm):
        import torch
        from transformers import AutoModelForCausalLM

        self.llm = llm
        src = Path(llm.source)
        if src.suffix == ".gguf":  # transformers' own GGUF loader (ours reads it tensor by tensor)
            self.model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                              dtype=torch.float32).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()

    def answer(self, question: str, passages: list, max_new_tokens: int, instruction: str | None = None,
               answer_prefix: str = "", chat=None) -> tuple[str, dict]:
        """(answer text, timings) for `question` over `passages`: the prompt is
        ``build_prompt(tokenizer, passages, question, instruction, answer_prefix, chat).ids()``, the text is
        cut at the first stop string; with a `chat` format (`LongDocQA.chat_format`) generation also stops
        at its end-of-turn tokens and the passage markers leave the text, as in `LongDocQA`."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        from ldqa.app.api import Passage
        from ldqa.app.chat import split_citations
        from ldqa.app.prompt import STOP_STRINGS, build_prompt

        tok = self.llm.tokenizer
        ids = build_prompt(tok, [p if hasattr(p, "page") else Passage.of(p) for p in passages], question,
                           instruction, answer_prefix, chat).ids()
        eos, times = set(tok.eos_ids) | set(chat.stop_ids if chat else ()), []
        stops = STOP_STRINGS + (chat.stop_strings if chat else ())

        def text_of(new: list[int]) -> tuple[str, bool]:
            new = new[: next((j for j, t in enumerate(new) if t in eos), len(new))]
            text = tok.decode(new).lstrip()
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
            return (text if cut is None else text[:cut]), cut is not None

        class Watch(StoppingCriteria):  # times every token; stops at a stop string
            def __call__(self, input_ids, scores, **kw):
                times.append(time.perf_counter())
                return torch.tensor([text_of(input_ids[0, len(ids):].tolist())[1]])

        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos),
                                      pad_token_id=min(eos), stopping_criteria=StoppingCriteriaList([Watch()]))
        total = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        n = next((j for j, t in enumerate(new) if t in eos), len(new))
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        timings = {"ttft_ms": (times[0] - t0) * 1000 if times else total * 1000, "prompt_tokens": len(ids),
                   "generated_tokens": n, "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                   "total_ms": total * 1000}
        text = text_of(new)[0].strip()
        return (split_citations(text)[0] if chat is not None else text), timings


def _recompute_kw(cfg: EvalConfig, mode: Mode, ex: dict) -> dict:
    """Block modes' keywords for `LongDocQA.answer`/`ask`: --block-anchors, --anchor-passages, and in block+recompute
    --recompute-ratio, --recompute-select ("oracle": the example's gold passage recomputed whole,
    nq-multidoc only); {} for other modes."""
    if not mode.attention.startswith("block"):
        return {}
    kw = {"block_anchors": True} if cfg.block_anchors else {}
    if cfg.anchor_passages is not None:
        kw["anchor_passages"] = cfg.anchor_passages
    if mode.attention != "block+recompute":
        return kw
    kw["recompute_ratio"] = cfg.recompute_ratio
    if cfg.recompute_select == "oracle":
        kw["recompute_select"] = (ex["gold_position"],)
    elif cfg.recompute_select is not None:
        kw["recompute_select"] = cfg.recompute_select
    return kw


def mode_options(cfg: EvalConfig, mode: Mode, ex: dict, max_new: int, **search):
    """The `AnswerOptions` example `ex` is answered with in `mode` (an ldqa attention mode, not "hf"):
    the mode's attention and debias method, the answer cap `max_new`, the example's own instruction and
    answer prefix, the block options of `_recompute_kw`, --debias-strength with the calibrate methods, and
    `search` (top_k, retriever, abstain_below: `ask` over a collection). Raises ValueError naming an
    option whose value is not allowed."""
    from ldqa.app.options import AnswerOptions
    from ldqa.attention.debias import DebiasConfig

    strength = {"debias_strength": cfg.debias_strength} if cfg.debias_strength is not None and \
        DebiasConfig(mode.debias).calibrates else {}
    return AnswerOptions(attention=mode.attention, debias=mode.debias, max_new_tokens=max_new,
                         instruction=ex.get("instruction"), answer_prefix=ex.get("answer_prefix", ""),
                         **_recompute_kw(cfg, mode, ex), **strength, **search)


def retrieve_for(qa, cfg: EvalConfig, ex: dict, mode: Mode) -> dict:
    """The retrieval benchmark's example `ex` with its passages retrieved for `mode`: a copy with
    "passages" (the top ``cfg.top_k``) and "retrieved" (`rank_metrics` of the top 10 and retrieval_ms).
    `answer_one` calls it, unless the example was retrieved already (by the Ray driver)."""
    t0 = time.perf_counter()
    hits = qa.retrieve(ex["question"], top_k=max(10, cfg.top_k), retriever=mode.retriever)
    row = rank_metrics([h.doc_id for h in hits], ex["gold_doc"])
    row["retrieval_ms"] = (time.perf_counter() - t0) * 1000
    return ex | {"passages": hits[: cfg.top_k], "retrieved": row}


def answer_one(qa, hf, cfg: EvalConfig, ex: dict, mode: Mode, max_new: int) -> dict:
    """Answer example `ex` in `mode` through the public API; the result row (prediction, score, timings).

    A model whose logits turn NaN/inf (`NonFiniteLogitsError`), or a question that does not fit the
    model's window (`PromptTooLongError`), gives an error row: "error" holds the message, "score" and the timings are None (`harness.run` leaves it out of the accuracy and does not cache
    it), never an empty prediction scored as a wrong answer. Other errors propagate."""
    if mode.collection:  # jsonl with a retriever: the record's context as its own collection
        return answer_from_collection(qa, cfg, ex, mode, max_new)

    from ldqa.app.prompt import PromptTooLongError
    from ldqa.attention.generate import NonFiniteLogitsError

    if cfg.benchmark == "retrieval" and "retrieved" not in ex:
        ex = retrieve_for(qa, cfg, ex, mode)
    passages, row, error = ex["passages"], ex.get("retrieved", {}), ex.get("skip_reason")
    used = mode.attention
    prompt = {"instruction": ex.get("instruction"), "answer_prefix": ex.get("answer_prefix", "")}
    with PeakMemory() as mem:
        if error:  # refused while the example was built (e.g. a question over --max-length)
            text, t = "", {}
        elif mode.attention == "hf":
            text, t = hf.answer(ex["question"], passages, max_new, **prompt, chat=qa.chat_format(prompt["instruction"]))
        else:
            opts = mode_options(cfg, mode, ex, max_new)
            try:
                ans = qa.answer(ex["question"], passages, **opts.overrides())
                text, t, used = ans.text, ans.timings.to_dict(), ans.settings.attention_used or mode.attention
                t["passages_dropped"] = ans.settings.passages_dropped or 0
            except (NonFiniteLogitsError, PromptTooLongError) as e:  # an error row, not a wrong answer
                text, t, error = "", {}, f"{type(e).__name__}: {e}"
    meta = {k: v for k, v in ex.items() if k not in ("passages", "id", "question", "answers", "instruction",
                                                     "answer_prefix", "skip_reason", "retrieved")}
    return {"mode": mode.label, "example_id": ex["id"], **meta, "question": ex["question"],
            "answers": ex["answers"], "prediction": text,
            "score": None if error else score(cfg.benchmark, text, ex["answers"]),
            **row, **{k: t.get(k) for k in ("ttft_ms", "tokens_per_s", "prompt_tokens", "generated_tokens",
                                            "total_ms", "stop_reason")},
            **({"passages_dropped": t["passages_dropped"]} if t.get("passages_dropped") else {}),
            "peak_mb": mem.peak, **({"gpu_peak_mb": mem.gpu_mb} if mem.gpu_mb is not None else {}),
            "attention_used": used, "n_passages": len(passages), **({"error": error} if error else {})}


# ------------------------------------------------------------------- jsonl over per-record collections

COLLECTION_FORMAT = 1  # how a record's context becomes a collection (one file, Context.txt); bump on change


class ContextIndexError(ValueError):
    """A jsonl record's context could not be ingested as a collection (the message says why)."""


def collection_settings(cfg: EvalConfig | None = None) -> dict:
    """What a per-record collection and its answers depend on besides the context and the run's
    settings: the chunking ldqa ingests with (`LongDocQA`'s chunk_tokens/overlap_tokens defaults, tokens of
    the LLM's tokenizer, or `cfg`'s), the embedding model, `ask`'s abstention threshold (the default of
    `AnswerOptions.abstain_below`, or `cfg.abstain_below`) and `COLLECTION_FORMAT`. Part of the collection
    directory's key and of the prediction cache key (`harness.mode_cache_key`); with none of `cfg`'s
    overrides set, the same dict (and keys) as without `cfg`."""
    import inspect

    from ldqa.app.api import LongDocQA
    from ldqa.app.options import default
    from ldqa.retrieval.embedders import DEFAULT_MODEL

    params = inspect.signature(LongDocQA.__init__).parameters
    st = {"chunk_tokens": params["chunk_tokens"].default, "overlap_tokens": params["overlap_tokens"].default,
          "embedder": DEFAULT_MODEL, "abstain_below": default("abstain_below"), "format": COLLECTION_FORMAT}
    if cfg is not None:
        st |= {k: getattr(cfg, k) for k in ("chunk_tokens", "overlap_tokens", "abstain_below")
               if getattr(cfg, k) is not None}
    return st


def collection_dir(root: Path, context_sha256: str, model: str, cfg: EvalConfig | None = None) -> Path:
    """The cached collection of the context whose sha256 (hex) is `context_sha256`, under `root`:
    ``<sha[:16]>-<h>``, h a hash of `collection_settings(cfg)` and the tokenizer's model name `model`
    (chunk sizes are counted in its tokens), so another chunking, embedder or tokenizer gets its own
    directory and a rerun finds the same one."""
    h = hashlib.sha256(json.dumps([collection_settings(cfg), model], sort_keys=True).encode()).hexdigest()
    return Path(root) / f"{context_sha256[:16]}-{h[:8]}"


def _context_file(qa, context_sha256: str, cfg: EvalConfig | None = None) -> Path:
    """Where `write_context` puts a context: ``Context.txt`` (the passages' title, as in the
    whole-context path) in its `collection_dir` under ``<qa's store>/../collections``."""
    return collection_dir(qa.store.path.parent / "collections", context_sha256, qa.model_name, cfg) / "doc" / \
        "Context.txt"


def write_context(qa, context: str, cfg: EvalConfig | None = None) -> str:
    """Write `context` to its collection's ``Context.txt`` (`_context_file`) unless it is there already;
    returns its sha256 (hex), which the example carries instead of the text."""
    sha = hashlib.sha256(context.encode("utf-8")).hexdigest()
    doc = _context_file(qa, sha, cfg)
    doc.parent.mkdir(parents=True, exist_ok=True)
    if not doc.exists() or doc.read_text(encoding="utf-8") != context:
        doc.write_text(context, encoding="utf-8")
    return sha


def open_collection(qa, context_sha256: str, max_new: int, cfg: EvalConfig | None = None) -> tuple:
    """(LongDocQA over the collection of a context `write_context` wrote, build info): its
    ``Context.txt`` is ingested with ldqa's own chunker, embedder and store (same model, weights and KV
    dtype as `qa`, whose loaded models it shares); a collection built before skips it (nothing embedded).
    Info: index_ms (the ingest call's wall time, ms), index_cached (True when the collection was already
    built), collection_chunks. Raises ContextIndexError (a ValueError) when the context file is missing or
    cannot be ingested (with the ingest result's reason)."""
    from ldqa.app.api import LongDocQA

    st = collection_settings(cfg)
    doc = _context_file(qa, context_sha256, cfg)
    if not doc.is_file():
        raise ContextIndexError(f"{doc}: the record's context was not written (the jsonl builder writes it)")
    root = doc.parent.parent
    item = LongDocQA(store=root / "store", model=qa.model_name, weights=qa.weights, kv_dtype=qa.kv_dtype,
                     device=qa.device, chat_template=qa.chat_template, max_new_tokens=max_new, chunk_tokens=st["chunk_tokens"], overlap_tokens=st["overlap_tokens"])
    report = item.ingest([doc])
    f = report.files[0]
    if f.status == "error":
        item.store.close()
        item.kv_store.close()
        raise ContextIndexError(f"the record's context could not be indexed: {f.reason}")
    return item, {"index_ms": report.ms, "index_cached": f.status == "skipped",
                  "collection_chunks": item.store.n_chunks()}


@contextlib.contextmanager
def collection_lock(root: Path):
    """Exclusive lock (fcntl.flock on ``<collection>/.answer.lock``) held while one answer builds, empties
    and asks a record's collection, so Ray workers answering other modes of the same record at the same
    time neither ingest it twice nor empty its KV block store under each other's cold/warm measurement.
    Blocks until free; where fcntl is missing (Windows) it locks nothing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = Path(root) / ".answer.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # closing the file releases the lock
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def answer_from_collection(qa, cfg: EvalConfig, ex: dict, mode: Mode, max_new: int) -> dict:
    """Answer jsonl example `ex` over its own collection (`open_collection`) with `LongDocQA.ask` (top
    --top-k chunks from `mode.retriever`, `mode`'s attention and debiasing, ask's abstention): the row of
    `answer_one` plus

    - retrieval_ms: the question's retrieval time (ms) in the first ask;
    - ttft_cold_ms (= ttft_ms, and the row's prediction and score): TTFT (prefill + first token, ms) of
      the first question over the collection as freshly built: its KV block store emptied first, a new
      `LongDocQA` (empty exact-prefill memo); the models loaded and, in block modes, the RoPE self-check
      done before the clock, as `LongDocQA.warm_up` does for a user. A bias curve (calibrate methods) is
      estimated once per passage count and mode and cached on disk, so only the first such row pays it.
    - ttft_warm_ms: the same question asked again over the same collection with its KV blocks now stored
      (block modes reuse them) but the exact-prefill memo emptied, so full attention prefills again as it
      would for any new question over the collection (not the copy of this very prompt it keeps);
      warm_same_answer says whether the second answer's text is the first's; tokens_reused and
      tokens_reused_warm: prompt tokens read from stored KV blocks in the first and the second ask;
    - gold_in_retrieved: 1.0 when a retrieved chunk holds a gold answer (`metrics.answer_in_passages`);
      retrieved: each chunk's character offsets "start:end" (end exclusive) in the context as loaded
      (`ldqa.retrieval.loaders`), in prompt order;
    - index_ms, index_cached, collection_chunks (`open_collection`); abstained: ask answered
      "Not found in the documents." without the model (TTFT then None: no prefill happened).

    Error rows as in `answer_one` (NonFiniteLogitsError, PromptTooLongError, a context that cannot be
    indexed). The whole answer holds the record's `collection_lock` (Ray workers answering other modes of
    the same record wait for it)."""
    from ldqa.app.prompt import PromptTooLongError
    from ldqa.attention.generate import NonFiniteLogitsError
    from ldqa.eval.metrics import answer_in_passages

    row, error, text, t, warm, used, passages = {}, None, "", {}, None, mode.attention, []
    opts = mode_options(cfg, mode, ex, max_new, top_k=cfg.top_k, retriever=mode.retriever,
                        abstain_below=collection_settings(cfg)["abstain_below"])
    item = None
    root = _context_file(qa, ex["context_sha256"], cfg).parent.parent
    with collection_lock(root), PeakMemory() as mem:
        try:
            item, row = open_collection(qa, ex["context_sha256"], max_new, cfg)
            item.kv_store.clear()  # cold: no block of this collection stored (another mode or run may have)
            item.warm_up()
            if mode.attention.startswith("block"):
                item.block_runtime  # noqa: B018  (RoPE self-check before the clock, once per LongDocQA)
            ans = item.ask(ex["question"], **opts.overrides())
            text, t, passages = ans.text, ans.timings.to_dict(), ans.passages
            used = ans.settings.attention_used or mode.attention
            abstained = bool(ans.settings.abstained)
            if not abstained:
                item.prefill_memo.clear()  # warm: blocks stored, but no copy of this exact prefill
                warm = item.ask(ex["question"], **opts.overrides())
            row |= {"abstained": abstained}
            if ans.settings.passages_dropped:
                row["passages_dropped"] = ans.settings.passages_dropped
        except (NonFiniteLogitsError, PromptTooLongError, ContextIndexError) as e:  # an error row
            text, t, error = "", {}, f"{type(e).__name__}: {e}"
        finally:
            if item is not None:
                item.store.close()
                item.kv_store.close()
    ttft = None if row.get("abstained") else t.get("ttft_ms")
    meta = {k: v for k, v in ex.items() if k not in ("passages", "id", "question", "answers", "instruction",
                                                     "answer_prefix", "skip_reason", "context_tokens_cut")}
    return {"mode": mode.label, "example_id": ex["id"], **meta, "question": ex["question"],
            "answers": ex["answers"], "prediction": text,
            "score": None if error else score(cfg.benchmark, text, ex["answers"]),
            "ttft_ms": ttft, "tokens_per_s": t.get("tokens_per_s"),
            "prompt_tokens": t.get("prompt_tokens") or None, "generated_tokens": t.get("generated_tokens"),
            "total_ms": t.get("total_ms"), "retrieval_ms": t.get("retrieval_ms"), "ttft_cold_ms": ttft,
            "ttft_warm_ms": warm.timings.ttft_ms if warm else None,
            "warm_same_answer": (warm.text == text) if warm else None,
            "tokens_reused": t.get("tokens_reused"),
            "tokens_reused_warm": warm.timings.tokens_reused if warm else None,
            "gold_in_retrieved": None if error else answer_in_passages([p.text for p in passages], ex["answers"]),
            "retrieved": [f"{p.start}:{p.end}" for p in passages], **row,
            "peak_mb": mem.peak, **({"gpu_peak_mb": mem.gpu_mb} if mem.gpu_mb is not None else {}),
            "attention_used": used, "n_passages": len(passages), **({"error": error} if error else {})}
