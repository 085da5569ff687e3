"""ldqa's Python API: ingest documents into a collection, ask questions, get cited answers.

    from ldqa import LongDocQA
    qa = LongDocQA(store="~/my-collection")
    report = qa.ingest(["manual.pdf", "notes/"])      # -> IngestReport
    answer = qa.ask("What is the maximum flow rate?")  # -> Answer(text, citations, passages, timings)
    for piece in qa.stream("..."): print(piece, end="")  # streaming; .answer when done
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

from ldqa.app.citations import Citation, cite
from ldqa.app.prompt import STOP_STRINGS, build_prompt, check_prompt_options

log = logging.getLogger(__name__)

RETRIEVERS = ("hybrid", "dense", "bm25")
ATTENTION_MODES = ("full", "block", "block+recompute", "retrieval")
# Bytes of KV cache copies that `LongDocQA` keeps (least recently used first out) to reuse identical exact
# prefills: another debias method on the same prompt, the same question asked again.
PREFILL_MEMO_BYTES = 256 << 20
DEFAULT_MAX_NEW_TOKENS = 64  # answer cap when neither the caller nor the collection sets one
# `ask` answers ABSTAIN_PHRASE without running the LLM when no retrieved passage reaches this dense cosine
# similarity (MiniLM): the question is about nothing in the collection. Chosen by
# `python -m ldqa.eval.bench_abstain --part retrieval` (docs/results.md, issue 31): midway between the
# off-topic questions on the bundled sample (at most 0.218) and the lowest answerable ones (0.323 on the
# sample; no answerable NQ-open question of 200 is below 0.3); higher thresholds catch more NQ questions
# whose answer was removed (0.4: 41%) but would refuse answerable questions of the sample.
ABSTAIN_BELOW = 0.25


@dataclass
class FileResult:
    """What happened to one input file: status "added" | "replaced" | "skipped" (same content already
    stored) | "error" (reason says why; the store is unchanged for this file). ms: this file's own time
    (loading, chunking, its share of the batch's embedding by chunk count, storing), not the batch's.
    warnings: what the loader could not read faithfully (e.g. glyphs without a Unicode mapping) in a
    file that was stored anyway."""

    path: str
    status: str
    chunks: int = 0
    doc_id: int | None = None
    reason: str = ""
    ms: float = 0.0
    warnings: list[str] = field(default_factory=list)


@dataclass
class IngestReport:
    """Per-file results of one `ingest` call plus totals; `ms` is the wall time of the call."""

    files: list[FileResult] = field(default_factory=list)
    ms: float = 0.0

    @property
    def added(self) -> int:
        return sum(f.status in ("added", "replaced") for f in self.files)

    @property
    def skipped(self) -> int:
        return sum(f.status == "skipped" for f in self.files)

    @property
    def errors(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "error"]

    @property
    def chunks(self) -> int:
        return sum(f.chunks for f in self.files if f.status in ("added", "replaced"))

    def to_dict(self) -> dict:
        return {"files": [asdict(f) for f in self.files], "ms": self.ms, "added": self.added,
                "skipped": self.skipped, "errors": len(self.errors), "chunks": self.chunks}


@dataclass
class Answer:
    """A cited answer.

    text: the answer; citations: Citation per cited passage; passages: the retrieved passages given to
    the model, in prompt order ([1]..[k]); timings: retrieval_ms, prefill_ms, ttft_ms (prefill + first
    token, ms), decode_ms, tokens_per_s (decode throughput), prompt_tokens, generated_tokens, total_ms;
    settings: what was asked for, with the defaults filled in (top_k, retriever, attention, model,
    recompute_ratio in block+recompute, block_headers in block modes, debias, and debias_orders,
    debias_calibration and debias_strength with the calibrate methods); when block reuse is off (its
    RoPE self-check failed) `attention_used` says "full" and `fallback_reason` why.
    timings also has tokens_reused / tokens_computed and, in block modes, kv_hits, kv_misses,
    kv_hit_rate, assemble_ms, encode_ms (with debiasing the lookups and encode_ms are the first context
    build's, which met the store as the question found it). With `debias` other than "none": debias_ms
    and debias_passes; "calibrate" and "calibrate+reorder" add bias_curve_ms (the bias curve's lookup;
    the first question for a number of passages and an attention mode estimates it, about 16 prefills,
    and that time is also in debias_ms and ttft_ms); "calibrate",
    "calibrate+reorder" and "sort" add passage_attention (k,) (attention mass from the question to
    each passage, as last measured) and the first two calibrated_relevance (k,) and passage_weights
    (k,) (the intervention's scale per passage), and with settings["debias_orders"] == 2
    passage_attention_reversed (k,) (each passage's mass measured with the order reversed). These
    per-passage lists follow `passages` (the final order).
    Prompt budget: settings["context_length"] is the model's window (tokens) and
    settings["passages_dropped"] how many of the lowest-ranked passages were left out so that the prompt
    plus the answer budget (max_new_tokens) fit it (`ldqa.app.prompt.fit_passages`); `passages` holds
    only those given to the model. settings["max_new_tokens"]: the answer budget used; `truncated`: the
    answer stopped there (timings["stop_reason"] == "max_new_tokens"), not at its end.
    """

    question: str
    text: str
    citations: list[Citation]
    passages: list
    timings: dict
    settings: dict

    @property
    def truncated(self) -> bool:
        """Whether generation stopped at max_new_tokens (the answer may be cut short)."""
        return self.timings.get("stop_reason") == "max_new_tokens"

    @property
    def notice(self) -> str:
        """What a reader should know about how this answer was made ("" when nothing): a cut answer, or
        passages left out to fit the model's window."""
        parts = []
        if self.truncated:
            parts.append(f"the answer was cut at max_new_tokens={self.settings.get('max_new_tokens')} tokens "
                         "(raise max_new_tokens for a longer one)")
        if self.settings.get("abstained"):
            parts.append(f"no passage is close enough to the question (best similarity "
                         f"{self.settings['best_dense_score']:.2f} < {self.settings['abstain_below']}), so the model "
                         "was not asked; rephrase, or ask anyway with --abstain-below 0 (API: abstain_below=None)")
        dropped = self.settings.get("passages_dropped", 0)
        if dropped:
            parts.append(f"{dropped} lowest-ranked passage{'s' if dropped > 1 else ''} left out to fit the "
                         f"model's context window of {self.settings.get('context_length')} tokens")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {"question": self.question, "text": self.text,
                "citations": [c.to_dict() for c in self.citations],
                "passages": [asdict(p) for p in self.passages], "timings": self.timings,
                "settings": self.settings, "truncated": self.truncated, "notice": self.notice}


class AnswerStream:
    """Iterate for answer text pieces as they are generated; `answer` holds the Answer afterwards."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        yield from self._pieces

    def result(self) -> Answer:
        """Drain the stream and return the Answer."""
        for _ in self:
            pass
        return self.answer


class LongDocQA:
    """One document collection (a store directory) and one LLM.

    Parameters
    ----------
    store : directory of the collection (created if missing); None = the default collection under the
        user's data dir.
    model : "gemma3-270m" (default), "smollm2-135m", a .gguf file or a Hugging Face model directory.
    chunk_tokens, overlap_tokens : chunk size and overlap, in the LLM tokenizer's tokens.
    index : "flat" (exact inner product, default) or "hnsw" (approximate, for large collections).
    max_new_tokens : answer length cap (tokens); None = the collection's saved setting
        (`save_answer_settings`, kept in the store) or `DEFAULT_MAX_NEW_TOKENS` (64).
    kv_budget_mb : in-memory budget of the KV block store (MB); blocks also persist under <store>/kv.
    weights : the LLM's weight format, "fp32" (reference), "bf16", "int8", "int4" or "q8_0" (weight-only
        quantization, `ldqa.attention.quant`); None = $LDQA_WEIGHTS or `loader.default_weights()` (q8_0,
        or int8 where q8_0's CPU kernel cannot be built).
    kv_dtype : "fp32" (default) or "bf16", the in-memory KV cache's dtype.

    The model is checked here, cheaply (no weights read): its file or directory exists and reads, and its
    architecture (a GGUF's `general.architecture`, a directory's config.json `model_type`) is a family the
    runtime implements. The weights themselves load on first use (`warm_up`, the first answer).

    Raises
    ------
    IndexMismatchError : the store was built with another embedding model.
    ModelLoadError : the model is not found, not installed, or its file cannot be read.
    UnsupportedModelError : the model's architecture is not a supported family (the message names it and
        the supported families and weight sources).
    WeightFormatError : an unknown weight format, float16, or one this torch build cannot run.
    Answering raises NonFiniteLogitsError (`ldqa.attention.generate`) when the model's logits hold NaN/inf.
    """

    def __init__(self, store: str | Path | None = None, model: str | None = None, chunk_tokens: int = 256,
                 overlap_tokens: int = 32, index: str | None = None, max_new_tokens: int | None = None,
                 kv_budget_mb: int = 512, weights: str | None = None, kv_dtype: str = "fp32"):
        from ldqa.attention.loader import (DEFAULT_MODEL, check_kv_dtype, check_model_name, check_weights,
                                           default_weights)
        from ldqa.indexes.store import Store, default_store_dir
        from ldqa.retrieval.chunking import ChunkConfig
        from ldqa.retrieval.embedders import Embedder

        self.model_name = model or DEFAULT_MODEL
        check_model_name(self.model_name)  # architecture and readability now, not at the first answer
        self.weights = check_weights(weights or default_weights())
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.chunk_config = ChunkConfig(chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)
        self.embedder = Embedder()
        self.store = Store(Path(store) if store else default_store_dir(), self.embedder.name,
                           self.embedder.dim, index_kind=index)
        saved = self.store.answer_settings().get("max_new_tokens")
        self.max_new_tokens = _check_max_new(max_new_tokens if max_new_tokens is not None else
                                             saved or DEFAULT_MAX_NEW_TOKENS)
        self._ingest_lock = threading.Lock()
        self._generate_lock = threading.Lock()  # one generation at a time per model (CPU-bound anyway)
        self._retriever = None
        from ldqa.indexes.kv_store import KVBlockStore

        self.kv_store = KVBlockStore(self.store.path / "kv", memory_budget_bytes=kv_budget_mb << 20)
        self.store.on_chunks_removed(self.kv_store.drop_chunks)  # replaced/deleted documents lose their blocks
        self._block_runtime = None
        # Recent exact prefills (attention="full"), least recently used first: answering the same prompt
        # again (another debias method, the same question asked twice) starts from a copy. `_full_prefill`.
        self._prefill_memo: OrderedDict = OrderedDict()
        # Attention Buckets runs the layers below the first global one once for all its branches (same
        # answers, bit for bit); False runs each branch's whole prefill (the side-by-side comparison in
        # `python -m ldqa.eval.diag_debias buckets-prefill`).
        self.share_bucket_layers = True

    # ----------------------------------------------------------------- ingestion
    def ingest(self, paths: str | Path | Iterable[str | Path], progress: bool = False) -> IngestReport:
        """Load, chunk, embed and store files (directories are walked recursively).

        Same bytes as a stored document -> "skipped"; a stored path with changed bytes -> "replaced" (old
        chunks and everything derived from them are dropped in the same transaction). A file that fails
        (unsupported type, empty, corrupt, encrypted or image-only PDF, binary, unreadable) gets an
        "error" result with the reason, logged to stderr; the other files go on; the store is unchanged
        for it. Raises nothing for bad files; raises ValueError if `paths` is empty.
        """
        from ldqa.retrieval.loaders import iter_paths

        if isinstance(paths, (str, Path)):
            paths = [paths]
        paths = list(paths)
        if not paths:
            raise ValueError("ingest: no paths given; pass files or directories")
        t0 = time.perf_counter()
        report = IngestReport()
        with self._ingest_lock:
            files = iter_paths(paths)
            bar = _progress(files, progress, "ingest")
            try:
                for group in _groups(list(files), 32):
                    report.files += self._ingest_group(group)
                    if hasattr(bar, "update"):
                        bar.update(len(group))
            finally:
                self.store.flush()
                if hasattr(bar, "close"):
                    bar.close()
        report.ms = (time.perf_counter() - t0) * 1000
        for f in report.errors:
            print(f"ldqa: {f.path}: {f.reason}", file=sys.stderr)
        for f in report.files:
            for w in f.warnings:
                log.warning("%s: %s", f.path, w)
        return report

    def _ingest_group(self, paths: list[Path]) -> list[FileResult]:
        """Load and chunk each file, embed the group's chunks in one batch, store each file in its own
        transaction. A failure in any step is that file's error result only."""
        prepared, first_of, twins = [], {}, []  # twins: (FileResult, sha) of in-batch duplicates
        given = {}  # absolute path -> the path as the caller gave it (reports use the latter)
        own_ms = {}  # absolute path -> ms spent loading and chunking that file
        for p in paths:
            t0 = time.perf_counter()
            x = self._prepare(Path(p))
            if not isinstance(x, FileResult):
                given[x[0].path] = str(p)
                own_ms[x[0].path] = _ms(t0)
                sha = x[0].sha256
                if sha in first_of:  # same bytes twice in one batch: the first one is stored
                    x = FileResult(str(p), "skipped", len(x[2]), None, f"same content as {first_of[sha]}",
                                   _ms(t0))
                    twins.append((x, sha))
                else:
                    first_of[sha] = x[0].path
            prepared.append(x)
        todo = [x for x in prepared if not isinstance(x, FileResult)]
        texts = [c.full_text for _, _, chunks in todo for c in chunks]
        t0 = time.perf_counter()
        try:
            vectors = self.embedder.encode(texts) if texts else None
        except Exception as e:  # embedding the batch failed: fall back to one file at a time
            log.warning("batch embedding failed (%s); embedding file by file", e)
            vectors = None
        embed_ms_per_chunk = _ms(t0) / max(1, len(texts)) if vectors is not None else 0.0
        out, row = [], 0
        for x in prepared:
            if isinstance(x, FileResult):
                out.append(x)
                continue
            doc, old, chunks = x
            t0, before = time.perf_counter(), own_ms[doc.path] + embed_ms_per_chunk * len(chunks)
            try:
                vec = vectors[row:row + len(chunks)] if vectors is not None else \
                    self.embedder.encode([c.full_text for c in chunks])
                doc_id = self.store.add_document(doc, chunks, vec)
                out.append(FileResult(given[doc.path], "replaced" if old else "added", len(chunks), doc_id, "",
                                      before + _ms(t0), list(doc.meta.get("warnings", []))))
            except Exception as e:  # one bad file never stops the rest
                log.exception("ingest failed for %s", doc.path)
                out.append(FileResult(given[doc.path], "error", reason=f"{type(e).__name__}: {e}",
                                      ms=before + _ms(t0)))
            row += len(chunks)
        stored = {r.path: r.doc_id for r in out if r.status in ("added", "replaced")}
        for r, sha in twins:  # in-batch duplicates point at the stored copy
            r.doc_id = stored.get(given[first_of[sha]])
        return out

    def _prepare(self, path: Path):
        """(Document, old stored row or None, chunks) for a file to store, or its FileResult when it is
        skipped (same content stored) or fails to load."""
        from ldqa.retrieval.chunking import chunk_document
        from ldqa.retrieval.loaders import LoadError, load_document

        t0 = time.perf_counter()
        try:
            doc = load_document(path)
            same = self.store.get_document_by_sha(doc.sha256)
            if same is not None:
                return FileResult(str(path), "skipped", same.get("n_chunks", 0), same["id"],
                                  f"same content as stored document {same['path']}", _ms(t0))
            chunks = chunk_document(doc, self.tokenizer.count, self.chunk_config)
            if not chunks:
                raise LoadError(path, "no text to index after chunking")
            return doc, self.store.get_document_by_path(doc.path), chunks
        except LoadError as e:
            return FileResult(str(path), "error", reason=getattr(e, "reason", str(e)), ms=_ms(t0))
        except Exception as e:  # one bad file never stops the rest
            log.exception("ingest failed for %s", path)
            return FileResult(str(path), "error", reason=f"{type(e).__name__}: {e}", ms=_ms(t0))

    def precompute_kv(self, doc_ids: Iterable[int] | None = None, progress: bool = False) -> dict:
        """Encode and store the KV block of every chunk of `doc_ids` (default: all) for the current model,
        so the first question over them already hits the store. Returns {"blocks", "computed", "ms"}.
        """
        from ldqa.app.prompt import build_prompt
        from ldqa.attention.block_attention import PrefillStats

        t0 = time.perf_counter()
        ids = self.store.chunk_ids(doc_ids)
        rows = self.store.get_chunks(ids)
        rt, tok = self.block_runtime, self.llm.tokenizer
        stats = PrefillStats()
        bar = _progress(rows, progress, "kv blocks")
        with self._generate_lock:
            for row in rows:
                p = Passage(row["title"], row["text"], row["page"], row["id"], header=row["header"])
                seg = build_prompt(tok, [p], "?")
                rt.get_block(seg.prefix, seg.passages[0], row["id"], stats)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return {"blocks": len(rows), "computed": stats.kv_misses, "ms": _ms(t0)}

    def delete(self, doc_id: int) -> int:
        """Delete a document with its chunks and vectors; returns how many chunks went."""
        with self._ingest_lock:
            removed = self.store.delete_document(doc_id)
            self.store.flush()
        return len(removed)

    def documents(self) -> list[dict]:
        """Stored documents (id, path, title, n_chunks, bytes, added_at, ...)."""
        return self.store.documents()

    def with_model(self, model: str) -> "LongDocQA":
        """This collection answered by another LLM: a LongDocQA sharing this one's store, embedder, KV
        block store, retriever and locks (so ingest/delete and generation stay serialized across both),
        with its own model and block runtime. Returns self when `model` is already this one's.

        Raises ModelLoadError / UnsupportedModelError (as the constructor) when `model` cannot be loaded.
        """
        import copy

        from ldqa.attention.loader import check_model_name

        if model == self.model_name:
            return self
        check_model_name(model)
        other = copy.copy(self)  # shallow: the store, locks and caches are the same objects
        other.model_name = model
        other._block_runtime = None
        return other

    # ----------------------------------------------------------------- models
    @property
    def tokenizer(self):
        from ldqa.attention.loader import load_tokenizer

        return load_tokenizer(self.model_name)

    @property
    def llm(self):
        """The loaded model (`loader.LoadedModel`), loaded on first use. Raises as `loader.load_model`, and
        WeightFormatError when its tensors were cast to float16 since (`generate.check_model_dtype`)."""
        from ldqa.attention.generate import check_model_dtype
        from ldqa.attention.loader import load_model

        lm = load_model(self.model_name, weights=self.weights, kv_dtype=self.kv_dtype)
        check_model_dtype(lm.model)
        return lm

    @property
    def retriever(self):
        from ldqa.retrieval.retriever import Retriever

        if self._retriever is None:
            self._retriever = Retriever(self.store, self.embedder)
        return self._retriever

    # ----------------------------------------------------------------- answering
    def retrieve(self, question: str, top_k: int = 5, retriever: str = "hybrid") -> list:
        """The passages `ask` would use (RetrievedPassage list, best first)."""
        _check_question(question, top_k, retriever)
        return self.retriever.search(question, top_k=top_k, mode=retriever)

    def ask(self, question: str, top_k: int = 5, retriever: str = "hybrid", attention: str = "full",
            max_new_tokens: int | None = None, recompute_ratio: float | None = None, debias: str = "none",
            block_headers: str | None = None, instruction: str | None = None, answer_prefix: str = "",
            debias_orders: int | None = None, debias_calibration: str | None = None,
            debias_strength: float | None = None, abstain_below: float | None = ABSTAIN_BELOW,
            **retrieval) -> Answer:
        """Answer `question` from the collection (blocking). See `stream` for arguments and errors."""
        return self.stream(question, top_k, retriever, attention, max_new_tokens, recompute_ratio, debias,
                           block_headers, instruction, answer_prefix, debias_orders=debias_orders,
                           debias_calibration=debias_calibration, debias_strength=debias_strength,
                           abstain_below=abstain_below, **retrieval).result()

    def stream(self, question: str, top_k: int = 5, retriever: str = "hybrid", attention: str = "full",
               max_new_tokens: int | None = None, recompute_ratio: float | None = None, debias: str = "none",
               block_headers: str | None = None, instruction: str | None = None, answer_prefix: str = "",
               debias_orders: int | None = None, debias_calibration: str | None = None,
               debias_strength: float | None = None, abstain_below: float | None = ABSTAIN_BELOW,
               **retrieval) -> AnswerStream:
        """Answer `question`, streaming text pieces; `.answer` (or `.result()`) gives the Answer.

        top_k >= 1 passages from `retriever` ("hybrid" RRF of dense + BM25, "dense", "bm25");
        attention: "full" (exact attention over the whole prompt), "block" (each passage's KV states
        computed once, stored and reused, re-positioned by RoPE re-encoding; only the question and the
        passage headers are cached blocks too, unless block_headers="fresh") or "block+recompute" (block, plus CacheBlend-style
        recomputation of a `recompute_ratio` fraction of each passage's tokens; default 0.15) or
        "retrieval" (exact prefill, then each decode step of a global-attention layer attends to the sink,
        the recent window and the top keys an ANN index over the cached keys returns: RetrievalAttention;
        keyword settings `top_k_keys` (an int, or "all" for exact attention), `window`, `sink`, `index`,
        `scan_fraction`, `follow` (carry-over of the previous step's best keys), `estimate` (the
        estimation zone for the keys not retrieved) of `ldqa.attention.retrieval_attention.RetrievalConfig`).
        debias: "none", "calibrate" (found-in-the-middle calibrated attention intervention),
        "calibrate+reorder" (also move the most relevant passages to the best-attended slots) or "sort"
        (attention sorting); see `ldqa.attention.debias` (not with attention="retrieval").
        debias_orders: passage orders the two calibrate methods measure attention in: 1 (the given
        order) or 2 (also reversed; each passage's calibrated relevance averaged over its two slots);
        default `ldqa.attention.debias.MEASURE_ORDERS` (2 in block modes: one more re-assembly from
        stored blocks; 1 with full attention, where it would cost another prefill).
        debias_calibration: how the two calibrate methods calibrate the measured attention a against the
        bias curve b: "difference" (a - b, found-in-the-middle), "ratio" (a / b) or "pearson"
        ((a - b) / sqrt(b)); default
        `ldqa.attention.debias.CALIBRATION` for the attention mode.
        debias_strength: the calibrate methods' intervention strength s >= 0 (log w_p = s * centred
        calibrated relevance, `ldqa.attention.debias.log_weights`; 0: no rescaling, calibrate+reorder
        then only reorders); default `ldqa.attention.debias.STRENGTH` for the calibration form.
        block_headers: "cached" (default; each "Passage [n]" header is a reused block, only the question
        is computed fresh) or "fresh" (headers computed with the question, attending to all before them).
        instruction: the prompt's instruction (default `ldqa.app.prompt.INSTRUCTION`); answer_prefix: the
        start of the answer, after "Answer:" (e.g. 'Corresponding value: "' for key-value retrieval); the
        answer's text is the model's continuation of it (see `ldqa.app.prompt.build_prompt`).
        abstain_below: when no retrieved passage has a dense cosine similarity of at least this value
        (dense and hybrid retrieval; bm25 has no such score), the answer is `prompt.ABSTAIN_PHRASE`
        ("Not found in the documents.") with the passages it looked at and no citation, and the LLM does
        not run (settings["abstained"], settings["best_dense_score"]); None or 0 turns it off. Default
        `ABSTAIN_BELOW` (0.25, measured; see there).
        The prompt is counted in the model's tokens before anything is computed: when it and
        max_new_tokens do not fit the model's window, the lowest-ranked passages are left out
        (settings["passages_dropped"]).
        Raises ValueError (empty question, top_k < 1, unknown retriever/attention mode or setting,
        instruction/answer_prefix not strings), PromptTooLongError (a ValueError: the question with the
        instruction and max_new_tokens does not fit the model's window, or leaves no room for one
        passage), EmptyCollectionError (nothing ingested yet); while
        streaming, NonFiniteLogitsError when the model's logits hold NaN/inf (no empty answer is returned
        as if it were one: the message names the model and weight format and says which to use).
        """
        _check_question(question, top_k, retriever)
        check_prompt_options(instruction, answer_prefix)
        _check_attention(attention, recompute_ratio, block_headers)
        rcfg = _retrieval_config(attention, retrieval)
        _check_debias(debias, attention, debias_orders, debias_calibration, debias_strength)
        if abstain_below is not None and (isinstance(abstain_below, bool) or
                                          not isinstance(abstain_below, (int, float)) or not -1 <= abstain_below <= 1):
            raise ValueError(f"abstain_below must be a cosine similarity in [-1, 1] or None, got {abstain_below!r}")
        self.warm_up()  # model loading is not part of a question's timings
        t0 = time.perf_counter()
        passages = self.retriever.search(question, top_k=top_k, mode=retriever)
        retrieval_ms = _ms(t0)
        settings = {"top_k": top_k, "retriever": retriever, "debias": debias, "debias_orders": debias_orders,
                    "debias_calibration": debias_calibration, "debias_strength": debias_strength,
                    "retrieval_config": rcfg, "block_headers": block_headers,
                    **_prompt_settings(instruction, answer_prefix)}
        dense = [p.dense_score for p in passages if getattr(p, "dense_score", None) is not None]
        if abstain_below and dense:
            settings |= {"abstain_below": float(abstain_below), "best_dense_score": max(dense),
                         "abstained": max(dense) < abstain_below}
            if settings["abstained"]:
                return self._abstention(question, passages, attention, retrieval_ms, settings, t0)
        return self._answer_stream(question, passages, attention, max_new_tokens, recompute_ratio,
                                   retrieval_ms, settings, t0)

    def answer(self, question: str, passages: list, attention: str = "full", max_new_tokens: int | None = None,
               recompute_ratio: float | None = None, debias: str = "none", block_headers: str | None = None,
               instruction: str | None = None, answer_prefix: str = "", debias_orders: int | None = None,
               debias_calibration: str | None = None, debias_strength: float | None = None, **retrieval) -> Answer:
        """Answer `question` over given passages (no retrieval), in the given order, numbered [1]..[k].

        passages: objects with `title`, `text`, `page` (may be None) and optionally `chunk_id`, `doc_id`,
        `path`, `start`, `end` (e.g. RetrievedPassage, or `Passage` records for benchmarks). Blocks of
        passages without a chunk_id are stored but not tied to a document. `attention` and the retrieval
        settings, `instruction`, `answer_prefix`, `debias_orders`, `debias_calibration` and
        `debias_strength` as in `stream`. Raises ValueError (empty question or passages, a bad setting),
        NonFiniteLogitsError when the model's logits hold NaN/inf.
        """
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question is empty: ask something")
        if not passages:
            raise ValueError("passages is empty: give at least one passage")
        _check_attention(attention, recompute_ratio, block_headers)
        check_prompt_options(instruction, answer_prefix)
        rcfg = _retrieval_config(attention, retrieval)
        _check_debias(debias, attention, debias_orders, debias_calibration, debias_strength)
        passages = [p if hasattr(p, "chunk_id") else Passage.of(p) for p in passages]
        self.llm  # noqa: B018  (load before timing)
        settings = {"top_k": len(passages), "retriever": "given", "retrieval_config": rcfg, "debias": debias,
                    "debias_orders": debias_orders, "debias_calibration": debias_calibration,
                    "debias_strength": debias_strength, "block_headers": block_headers,
                    **_prompt_settings(instruction, answer_prefix)}
        return self._answer_stream(question, passages, attention, max_new_tokens, recompute_ratio, 0.0,
                                   settings, time.perf_counter()).result()

    def save_answer_settings(self, max_new_tokens: int) -> dict:
        """Keep `max_new_tokens` with the collection (its store's meta table), so every later
        `LongDocQA` on this store, the CLI and the web app start from it; also this object's default now.
        Returns the collection's saved answer settings. Raises ValueError for max_new_tokens < 1."""
        self.max_new_tokens = _check_max_new(max_new_tokens)
        return self.store.set_answer_settings(max_new_tokens=self.max_new_tokens)

    def warm_up(self) -> None:
        """Load the embedding model and the LLM now (otherwise the first question pays for it). Raises as
        `llm` (ModelLoadError, UnsupportedModelError, WeightFormatError) when the LLM cannot be loaded."""
        self.embedder.model  # noqa: B018
        self.llm  # noqa: B018

    @property
    def block_runtime(self):
        """The BlockRuntime of the current model (created, and RoPE self-checked, on first use)."""
        from ldqa.attention.block_attention import BlockRuntime

        if self._block_runtime is None:
            llm = self.llm
            rt = BlockRuntime(llm.model, llm.fingerprint, self.kv_store)
            rt.self_check()
            self._block_runtime = rt
        return self._block_runtime

    def _answer_stream(self, question, passages, attention, max_new, ratio, retrieval_ms, settings, t0):
        settings = {**settings, "attention": attention, "model": self.model_name, "weights": self.weights,
                    "kv_dtype": self.kv_dtype}
        rcfg = settings.pop("retrieval_config", None)
        if rcfg is not None:
            settings["retrieval"] = asdict(rcfg)
        if attention == "block+recompute":
            from ldqa.attention.block_attention import DEFAULT_RECOMPUTE_RATIO

            settings["recompute_ratio"] = DEFAULT_RECOMPUTE_RATIO if ratio is None else ratio
        if attention.startswith("block"):
            from ldqa.attention.block_attention import DEFAULT_HEADERS

            settings["block_headers"] = settings.get("block_headers") or DEFAULT_HEADERS
        else:
            settings.pop("block_headers", None)
        if settings.get("debias") in ("calibrate", "calibrate+reorder"):
            from ldqa.attention.debias import CALIBRATION, MEASURE_ORDERS, STRENGTH

            settings["debias_orders"] = settings.get("debias_orders") or MEASURE_ORDERS[attention]
            settings["debias_calibration"] = settings.get("debias_calibration") or CALIBRATION[attention]
            strength = settings.get("debias_strength")
            strength = STRENGTH[settings["debias_calibration"]] if strength is None else strength
            settings["debias_strength"] = float(strength)
        else:
            ignored = {k: v for k in ("debias_orders", "debias_calibration", "debias_strength")
                       if (v := settings.pop(k, None)) is not None}
            if ignored:
                log.warning("%s: only the calibrate methods use %s; ignored with debias=%r",
                            ", ".join(f"{k}={v!r}" for k, v in ignored.items()),
                            "it" if len(ignored) == 1 else "them", settings.get("debias"))
        max_new = max_new or self.max_new_tokens
        passages = self._fit_window(question, passages, max_new, settings)
        stream = AnswerStream(iter(()))
        stream._pieces = self._generate(stream, question, passages, retrieval_ms, settings, max_new, t0, rcfg)
        return stream

    def _abstention(self, question, passages, attention, retrieval_ms, settings, t0) -> AnswerStream:
        """The answer when no passage is close enough to the question: ABSTAIN_PHRASE, no LLM run."""
        from ldqa.app.prompt import ABSTAIN_PHRASE

        settings = {k: v for k, v in settings.items() if v is not None and k != "retrieval_config"}
        settings |= {"attention": attention, "model": self.model_name, "weights": self.weights,
                     "kv_dtype": self.kv_dtype}
        timings = {"retrieval_ms": retrieval_ms, "prefill_ms": 0.0, "ttft_ms": 0.0, "decode_ms": 0.0,
                   "tokens_per_s": 0.0, "prompt_tokens": 0, "generated_tokens": 0, "stop_reason": "abstained",
                   "tokens_reused": 0, "tokens_computed": 0, "total_ms": _ms(t0)}
        stream = AnswerStream(iter([ABSTAIN_PHRASE]))
        stream.answer = Answer(question, ABSTAIN_PHRASE, [], passages, timings, settings)
        return stream

    def _fit_window(self, question, passages, max_new, settings) -> list:
        """The passages that fit the model's window with the question and `max_new` answer tokens (the
        lowest-ranked dropped first), recorded in `settings`. Raises PromptTooLongError (a ValueError)
        when the question cannot fit, before anything is computed."""
        from ldqa.app.prompt import fit_passages

        llm = self.llm
        window = int(llm.model.cfg.max_position_embeddings)
        kept, _, n_prompt = fit_passages(llm.tokenizer, passages, question, window, max_new,
                                         settings.get("instruction"), settings.get("answer_prefix", ""))
        settings.update(max_new_tokens=max_new, context_length=window, passages_dropped=len(passages) - len(kept))
        if len(kept) < len(passages):
            log.warning("prompt over the model's window of %d tokens (%d reserved for the answer): %d "
                        "lowest-ranked passage(s) left out, %d kept (%d prompt tokens)", window, max_new,
                        len(passages) - len(kept), len(kept), n_prompt)
        return kept

    def _generate(self, stream: AnswerStream, question, passages, retrieval_ms, settings, max_new, t0, rcfg=None):
        from ldqa.attention.generate import SamplingConfig, continue_generation

        llm = self.llm
        cfg = SamplingConfig(max_new_tokens=max_new, stop_strings=STOP_STRINGS)
        mode = settings["attention"]
        debias = settings.get("debias", "none")
        with self._generate_lock:
            t_start = time.perf_counter()
            if mode.startswith("block") and not self.block_runtime.enabled:
                settings["attention_used"] = "full"
                settings["fallback_reason"] = self.block_runtime.disabled_reason
                mode = "full"
            policy = None
            if mode == "retrieval":
                from ldqa.attention.retrieval_attention import RetrievalKV

                policy = RetrievalKV(rcfg, llm.model.cfg.attn_scale)
            dstats = {}
            runner = llm.model
            if debias == "none":
                ctx = self._build_context(passages, question, mode, settings, max_new, policy)
            elif debias == "buckets":
                ctx, runner, dstats = self._bucket_context(passages, question, mode, settings, max_new)
            else:
                ctx, passages, dstats = self._debiased_context(passages, question, mode, settings, max_new)
            gen = continue_generation(runner, ctx.cache, ctx.logits, llm.tokenizer.decode, llm.tokenizer.eos_ids,
                                      cfg, t0=t_start)
            for _, delta in gen:
                yield delta
            if debias == "buckets":
                dstats["bucket_steps_chosen"] = list(runner.chosen)
        text = gen.text.strip()
        s = gen.stats
        timings = {"retrieval_ms": retrieval_ms, "prefill_ms": s.prefill_ms, "ttft_ms": s.ttft_ms,
                   "decode_ms": s.decode_ms, "tokens_per_s": s.tokens_per_s, "prompt_tokens": s.prompt_tokens,
                   "generated_tokens": s.generated_tokens, "stop_reason": s.stop_reason, "total_ms": _ms(t0)}
        if policy is not None:
            timings |= policy.stats.to_dict()
        if ctx.block_stats is not None:
            timings |= ctx.block_stats.to_dict()
        else:
            timings |= {"tokens_reused": 0, "tokens_computed": s.prompt_tokens}
        timings |= dstats
        timings.setdefault("reused_prefill_ms", ctx.reused_prefill_ms)
        stream.answer = Answer(question, text, cite(text, passages), passages, timings, settings)


    def _build_context(self, passages, question, mode, settings, max_new, policy=None):
        """Prefill the prompt for `passages` in attention `mode` ("full"/"retrieval": one exact pass;
        "block"/"block+recompute": assembled from stored blocks) with `policy` as the cache's hook.
        Returns a _Context (prompt segments, cache, next-token logits, block stats)."""
        import torch

        llm = self.llm
        prompt = _build_prompt(llm.tokenizer, passages, question, settings)
        if mode == "full" and policy is None:
            return self._full_prefill(prompt, max_new, settings.get("theta_scale", 1.0))
        if mode in ("full", "retrieval"):
            ids = prompt.ids()
            cache = llm.model.new_cache(capacity=len(ids) + max_new + 8)
            cache.policy = policy
            logits = llm.model(torch.tensor([ids]), torch.arange(len(ids)), cache)
            return _Context(prompt, cache, logits, None)
        from ldqa.attention.block_attention import DEFAULT_HEADERS

        cache, logits, stats = self.block_runtime.prefill(
            prompt, [getattr(p, "chunk_id", None) for p in passages], mode=mode,
            recompute_ratio=settings.get("recompute_ratio", 0.0), extra_capacity=max_new + 8, policy=policy,
            headers=settings.get("block_headers") or DEFAULT_HEADERS)
        return _Context(prompt, cache, logits, stats)

    def _prefill_key(self, prompt, theta_scale: float = 1.0) -> tuple:
        return tuple(prompt.ids()), self.llm.fingerprint, float(theta_scale)

    def _full_prefill(self, prompt, max_new, theta_scale: float = 1.0, shared: dict | None = None):
        """Exact prefill of `prompt` (attention="full") with the question's queries recorded (for the
        debias methods' attention measurement; recording does not change the attention). `theta_scale`
        multiplies the RoPE base of the global layers (Attention Buckets' branches; 1 = the model).
        `shared`: the layers below the first global one, already run on this prompt (`_shared_layers`);
        the prefill then starts there, bit-identical to a whole one (those layers do not see the scale).

        Recent prefills are kept (copies of their KV caches, at most `PREFILL_MEMO_BYTES` in all, least
        recently used dropped first): the same prompt again starts from a copy, bit-identical to
        computing it anew. The context then carries `reused_prefill_ms`, the measured time of the
        prefill it reused (with a shared start: that start's time included), so that latency reports can
        add it back (what a caller asking only this would have waited). Returns a _Context."""
        import torch

        from ldqa.attention.debias import DebiasKV

        llm = self.llm
        ids = prompt.ids()
        key = self._prefill_key(prompt, theta_scale)
        memo = self._prefill_memo.get(key)
        if memo is not None:
            self._prefill_memo.move_to_end(key)
            return _Context(prompt, memo["cache"].clone(), memo["logits"].clone(), None, memo["queries"], memo["ms"])
        t0 = time.perf_counter()
        rec = DebiasKV(n_record=len(prompt.question), scale=llm.model.cfg.attn_scale)
        if shared is None:
            cache = llm.model.new_cache(capacity=len(ids) + max_new + 8)
            start, shared_ms = None, 0.0
        else:  # the shared layers' K/V sit in the copy's next slots; the pass resumes at the first global layer
            cache = shared["cache"].clone()
            start, shared_ms = (shared["layer"], shared["hidden"]), shared["ms"]
        cache.policy, cache.theta_scale = rec, float(theta_scale)
        logits = llm.model(torch.tensor([ids]), torch.arange(len(ids)), cache, start=start)
        cache.policy = None
        ms, size = _ms(t0) + shared_ms, cache.capacity * cache.nbytes() // max(1, cache.length)  # bytes of a copy
        if size <= PREFILL_MEMO_BYTES:
            memo = self._prefill_memo
            while memo and size + sum(m["bytes"] for m in memo.values()) > PREFILL_MEMO_BYTES:
                memo.popitem(last=False)
            memo[key] = {"cache": cache.clone(), "logits": logits.clone(), "queries": rec.queries, "ms": ms,
                         "bytes": size}
        return _Context(prompt, cache, logits, None, rec.queries)

    def _measure(self, passages, question, mode, settings, max_new):
        """Build the context with the question's queries recorded; (context, (k,) attention mass)."""
        import torch

        from ldqa.attention.debias import DebiasKV, passage_mass, passage_spans

        llm = self.llm
        n_q = len(_build_prompt(llm.tokenizer, passages[:1], question, settings).question)
        if mode == "full":  # the exact prefill records the question's queries itself
            ctx = self._build_context(passages, question, mode, settings, max_new)
            queries = ctx.queries
        else:
            rec = DebiasKV(n_record=n_q, scale=llm.model.cfg.attn_scale)
            ctx = self._build_context(passages, question, mode, settings, max_new, rec)
            ctx.cache.policy = None
            queries = rec.queries
        L = ctx.cache.length
        mass = passage_mass(llm.model, ctx.cache, queries, passage_spans(ctx.prompt), torch.arange(L - n_q, L))
        return ctx, mass

    def bias_curve(self, k: int, attention: str = "full", n_examples: int = 16, seed: int = 0,
                   block_headers: str | None = None, theta_scale: float = 1.0):
        """The model's position-only attention bias for k passages (k,), in `attention` mode ("full" or a
        block mode, with `block_headers` as in `stream`): found-in-the-middle calibration on irrelevant
        passages from the bundled sample, computed once and cached on disk (per model fingerprint, k,
        mode, n_examples, seed). `theta_scale` (full attention only) multiplies the global layers' RoPE
        base, as an Attention Buckets branch does: where its troughs fall. Raises ValueError for a
        theta_scale other than 1 in a block mode (stored blocks carry the model's base)."""
        from ldqa.attention.block_attention import DEFAULT_HEADERS
        from ldqa.attention.debias import bias_cache_path, estimate_bias, load_or_estimate_bias
        from ldqa.attention.loader import cache_root

        llm = self.llm
        if theta_scale != 1.0 and attention != "full":
            raise ValueError(f"theta_scale={theta_scale} needs attention='full', not {attention!r}")
        settings = {"recompute_ratio": 0.15, "block_headers": block_headers or DEFAULT_HEADERS,
                    "theta_scale": float(theta_scale)}
        key = attention + (f"-{settings['block_headers']}-headers" if attention.startswith("block") else "")
        key += f"-rope{theta_scale:g}" if theta_scale != 1.0 else ""
        path = bias_cache_path(cache_root(), llm.fingerprint, k, key, n_examples, seed)

        def measure(ps, q):
            return self._measure([Passage.of(p) for p in ps], q, attention, settings, 1)[1]

        return load_or_estimate_bias(path, lambda: estimate_bias(measure, llm.tokenizer, k, n_examples, seed))

    def _shared_layers(self, prompt, max_new) -> dict | None:
        """The layers of `prompt`'s exact prefill below the model's first global-attention layer, which
        no RoPE scale of the global layers changes (Gemma 3 270M: 5 sliding-window layers of 18): a dict
        with the cache holding their K/V in its next slots (not yet counted in its length), the hidden
        states (1, n, hidden) entering the first global layer, that layer's index and the time taken (ms);
        None when the first layer is global (Llama, Qwen: nothing to share)."""
        import torch

        from ldqa.attention.debias import global_layers

        llm = self.llm
        first = min(global_layers(llm.model.cfg), default=0)
        if first == 0:
            return None
        t0 = time.perf_counter()
        ids = prompt.ids()
        cache = llm.model.new_cache(capacity=len(ids) + max_new + 8)
        hidden = llm.model(torch.tensor([ids]), torch.arange(len(ids)), cache, n_layers=first)
        return {"cache": cache, "hidden": hidden, "layer": first, "ms": _ms(t0)}

    def _bucket_context(self, passages, question, mode, settings, max_new):
        """Attention Buckets (ldqa.attention.debias.BUCKET_SCALES): one exact prefill per RoPE base scale
        of the global layers. Returns (branch 0's context with the ensemble's first logits, the
        BucketEnsemble that decodes all branches, timings)."""
        from ldqa.attention.debias import BUCKET_SCALES
        from ldqa.attention.generate import BucketEnsemble

        t0 = time.perf_counter()
        llm = self.llm
        scales = tuple(settings.get("bucket_scales") or BUCKET_SCALES)
        prompt = _build_prompt(llm.tokenizer, passages, question, settings)
        shared = None  # the layers below the first global one are the same in every branch: run them once
        missing = sum(self._prefill_key(prompt, s) not in self._prefill_memo for s in scales)
        if self.share_bucket_layers and missing > 1:
            shared = self._shared_layers(prompt, max_new)
        branches = [self._full_prefill(prompt, max_new, s, shared) for s in scales]  # each kept as exact prefills are
        ens = BucketEnsemble(llm.model, [b.cache for b in branches])
        first = ens.pick([b.logits for b in branches])
        settings["bucket_scales"] = list(scales)
        reused = sum(b.reused_prefill_ms for b in branches)
        return (_Context(prompt, branches[0].cache, first, None, reused_prefill_ms=reused), ens,
                {"debias_ms": _ms(t0), "debias_passes": len(scales)})

    def _debiased_context(self, passages, question, mode, settings, max_new):
        """Position debiasing (ldqa.attention.debias). Returns (context ready to decode, passages in their
        final order, timings)."""
        import torch

        from ldqa.attention import debias as D

        t0 = time.perf_counter()
        method = settings["debias"]
        llm = self.llm
        passes = 1
        ctx, mass = self._measure(passages, question, mode, settings, max_new)
        first = ctx  # block modes: the build that met the store as the question found it
        reused = ctx.reused_prefill_ms
        out = {}
        if method == "sort":
            for _ in range(settings.get("sort_rounds", 2)):
                order = D.sort_order(mass)
                if order == list(range(len(passages))):
                    break
                passages = [passages[i] for i in order]
                ctx, mass = self._measure(passages, question, mode, settings, max_new)
                reused += ctx.reused_prefill_ms
                passes += 1
            ctx.cache.policy = None
        else:
            t_bias = time.perf_counter()
            bias = self.bias_curve(len(passages), mode if mode != "retrieval" else "full",
                                   block_headers=settings.get("block_headers"))
            out["bias_curve_ms"] = _ms(t_bias)
            k, rctx, rev = len(passages), None, None
            form = settings["debias_calibration"]
            if settings.get("debias_orders", 1) == 2 and k > 1:  # also measure in the reversed order
                rctx, mass_rev = self._measure(passages[::-1], question, mode, settings, max_new)
                reused += rctx.reused_prefill_ms
                passes += 1
                rel = D.two_order_relevance(mass, mass_rev, bias, form)
                rev = mass_rev.flip(0)  # per passage, in the given order
            else:
                rel = D.calibrated_relevance(mass, bias, form)
            measured = mass  # by slot, as measured: what "pearson" normalises by, with bias
            if method == "calibrate+reorder":
                order = D.reorder_for_bias(rel, bias)
                passages, rel, mass = [passages[i] for i in order], rel[order], mass[order]
                rev = rev[order] if rev is not None else None
                if order == list(range(k))[::-1] and rctx is not None:
                    ctx = rctx  # the reversed context is already built
                elif order != list(range(k)):
                    ctx = self._build_context(passages, question, mode, settings, max_new)
                    reused += ctx.reused_prefill_ms
                    passes += 1
            log_w = D.log_weights(rel, measured, settings.get("debias_strength"), form, bias=bias)
            L = ctx.cache.length
            n_q = len(ctx.prompt.question)
            hook = D.DebiasKV(log_w=D.slot_bias(D.passage_spans(ctx.prompt), log_w, L + max_new + 8),
                              scale=llm.model.cfg.attn_scale)
            ctx.cache.policy = hook
            q_slots = torch.arange(L - n_q, L)  # the question, recomputed in place under the intervention
            ctx.logits = llm.model(torch.tensor([ctx.prompt.question]), ctx.cache.positions[q_slots].clone(),
                                   ctx.cache, slots=q_slots)
            out["passage_weights"] = log_w.exp().tolist()
            if rev is not None:
                out["passage_attention_reversed"] = rev.tolist()
            out["calibrated_relevance"] = rel.tolist()
        out |= {"debias_ms": _ms(t0), "debias_passes": passes, "passage_attention": mass.tolist(),
                "reused_prefill_ms": reused}
        if ctx is not first and first.block_stats is not None and ctx.block_stats is not None:
            # later builds find every block stored by the first: report what the store held before this
            # question (the first's lookups, reuse and computed tokens) and all the encoding
            fs = first.block_stats
            ctx.block_stats = replace(ctx.block_stats, kv_hits=fs.kv_hits, kv_misses=fs.kv_misses,
                                      tokens_reused=fs.tokens_reused, tokens_computed=fs.tokens_computed,
                                      encode_ms=fs.encode_ms + ctx.block_stats.encode_ms)
        return ctx, passages, out


def _check_max_new(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {n!r}")
    return n


def _prompt_settings(instruction, answer_prefix) -> dict:
    """The prompt options to record in an Answer's settings (only those that differ from the default)."""
    return ({"instruction": instruction} if instruction is not None else {}) | (
        {"answer_prefix": answer_prefix} if answer_prefix else {})


def _build_prompt(tokenizer, passages, question, settings):
    return build_prompt(tokenizer, passages, question, settings.get("instruction"), settings.get("answer_prefix", ""))


@dataclass
class _Context:
    prompt: object
    cache: object
    logits: object
    block_stats: object
    queries: dict | None = None  # full attention: layer -> (heads, question tokens, head_dim) recorded queries
    reused_prefill_ms: float = 0.0  # > 0: the prefill was a copy of an earlier identical one that took this long


@dataclass
class Passage:
    """A passage given directly to `LongDocQA.answer` (benchmarks): title, text, optional page/ids."""

    title: str
    text: str
    page: int | None = None
    chunk_id: int | None = None
    doc_id: int | None = None
    path: str = ""
    start: int = 0
    end: int = 0
    header: str = ""

    @classmethod
    def of(cls, obj) -> "Passage":
        if isinstance(obj, dict):
            return cls(**{k: v for k, v in obj.items() if k in cls.__dataclass_fields__})
        return cls(obj.title, obj.text, getattr(obj, "page", None), header=getattr(obj, "header", ""))


def _check_attention(attention, ratio, block_headers=None) -> None:
    from ldqa.attention.block_attention import HEADER_MODES

    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_MODES)}")
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be in [0, 1], got {ratio}")
    if block_headers is not None and block_headers not in HEADER_MODES:
        raise ValueError(f"block_headers={block_headers!r}: choose one of {', '.join(HEADER_MODES)}")


def _check_debias(debias: str, attention: str, orders: int | None = None, calibration: str | None = None,
                  strength: float | None = None) -> None:
    from ldqa.attention.debias import CALIBRATION_FORMS, METHODS

    if debias not in METHODS:
        raise ValueError(f"debias={debias!r}: choose one of {', '.join(METHODS)}")
    if orders is not None and (isinstance(orders, bool) or orders not in (1, 2)):
        raise ValueError(f"debias_orders={orders!r}: choose 1 (the given order) or 2 (also reversed), or None "
                         "for the default")
    if calibration is not None and calibration not in CALIBRATION_FORMS:
        raise ValueError(f"debias_calibration={calibration!r}: choose one of {', '.join(CALIBRATION_FORMS)}, or None "
                         "for the default")
    if strength is not None and (isinstance(strength, bool) or not isinstance(strength, (int, float))
                                 or not math.isfinite(strength) or strength < 0):
        raise ValueError(f"debias_strength={strength!r}: give a finite number >= 0 (0: no rescaling), or None for "
                         "the default (ldqa.attention.debias.STRENGTH)")
    if debias != "none" and attention == "retrieval":
        raise ValueError("debias methods work with attention='full', 'block' or 'block+recompute', not 'retrieval'")
    if debias == "buckets" and attention != "full":
        raise ValueError("debias='buckets' needs attention='full': stored blocks hold keys encoded with the "
                         "model's own RoPE base, and buckets change it (use 'calibrate' or 'sort' with block modes)")


def _retrieval_config(attention: str, settings: dict):
    """The RetrievalConfig of `attention="retrieval"` from keyword settings (None values = defaults).

    Raises ValueError for settings given with another attention mode or unknown/out-of-range settings.
    """
    from ldqa.attention.retrieval_attention import RetrievalConfig

    settings = {k: v for k, v in settings.items() if v is not None}  # None = not given: the default
    if attention != "retrieval":
        if settings:
            raise ValueError(f"{', '.join(sorted(settings))} only apply to attention='retrieval'")
        return None
    known = set(RetrievalConfig.__dataclass_fields__)
    bad = sorted(set(settings) - known)
    if bad:
        raise ValueError(f"unknown retrieval setting(s) {', '.join(bad)}: use {', '.join(sorted(known))}")
    if settings.get("top_k_keys") == "all":  # every indexed key: exact attention through the same path
        settings["top_k_keys"] = None
    return RetrievalConfig(**settings)


def _check_question(question, top_k, retriever) -> None:
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question is empty: ask something, e.g. ldqa ask \"What is ...?\"")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if retriever not in RETRIEVERS:
        raise ValueError(f"retriever={retriever!r}: choose one of {', '.join(RETRIEVERS)}")


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _groups(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _progress(items, on: bool, desc: str):
    """A tqdm bar over `items` (updated by the caller), or None when off."""
    if not on:
        return None
    from tqdm import tqdm

    return tqdm(total=len(items), desc=desc, unit="file", file=sys.stderr)
