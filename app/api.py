"""ldqa's Python API: ingest documents into a collection, ask questions, get cited answers.

    from ldqa import LongDocQA
    qa = LongDocQA(store="~/my-collection")
    report = qa.ingest(["manual.pdf", "notes/"])      # -> IngestReport
    answer = qa.ask("What is the maximum flow rate?")  # -> Answer(text, citations, passages, timings)
    for piece in qa.stream("..."): print(piece, end="")  # streaming; .answer when done
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Iterable

from ldqa.app.answer import (ABSTAINED, Answer, AnswerStream, Passage, Settings, Timings,  # noqa: F401  (re-exported)
                             repeats_itself)
from ldqa.app.chat import CHAT_INSTRUCTION, check_chat_template, split_citations
from ldqa.app.citations import cite
from ldqa.app.options import RETRIEVERS, SEARCH_OPTIONS, AnswerOptions  # noqa: F401  (RETRIEVERS re-exported)
from ldqa.app.options import check as check_option
from ldqa.app.options import default as option_default
from ldqa.app.prompt import STOP_STRINGS, anchor_ids, build_prompt, check_prompt_options
from ldqa.attention.choices import ATTENTION_MODES, DEFAULT_DEBIAS, default_debias  # noqa: F401  (re-exported)
from ldqa.retrieval.ingest import FileResult, IngestReport, ingest_files, progress_bar  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 64  # answer cap when neither the caller nor the collection sets one
# What `ask`/`stream`/`answer`, `ldqa ask`/`demo` and the web app answer with when the user names nothing:
# the defaults of `AnswerOptions` (`ldqa.app.options`, where each says why), here by name.
DEFAULT_ATTENTION = option_default("attention")
DEFAULT_TOP_K = option_default("top_k")
ABSTAIN_BELOW = option_default("abstain_below")


def precompute_kv_by_default() -> bool:
    """Whether `ldqa ingest` (and the demo) encode every new chunk's KV block at ingest time: when the
    default attention mode (`AnswerOptions.attention`'s default) reuses stored blocks, so the first
    question over new documents is warm too."""
    return option_default("attention").startswith("block")


class LongDocQA:
    """One document collection (a store directory) and one LLM.

    Parameters
    ----------
    store : directory of the collection (created if missing); None = the default collection under the
        user's data dir.
    model : "qwen2.5-coder-1.5b-instruct" (default), "qwen2.5-coder-0.5b-instruct", "gemma3-270m",
        "smollm2-135m", a .gguf file or a Hugging Face model directory.
    chunk_tokens, overlap_tokens : chunk size and overlap, in the LLM tokenizer's tokens.
    index : "flat" (exact inner product, default) or "hnsw" (approximate, for large collections).
    max_new_tokens : answer length cap (tokens); None = the collection's saved setting
        (`save_answer_settings`, kept in the store) or `DEFAULT_MAX_NEW_TOKENS` (64).
    kv_budget_mb : in-memory budget of the KV block store (MB); blocks also persist under <store>/kv.
    weights : the LLM's weight format, "fp32" (reference), "bf16", "int8", "int4", "q8_0" (weight-only
        quantization, `ldqa.attention.quant`) or "gguf" (a GGUF model's own quantized blocks); None =
        $LDQA_WEIGHTS or `loader.default_weights(model, device)` (on the CPU gguf for a GGUF model, q8_0 for
        a Hugging Face directory, int8 where their CPU kernel cannot be built; bf16 on CUDA).
    kv_dtype : "fp32" or "bf16", the in-memory KV cache's dtype; None = the device's default (fp32 on the
        CPU, bf16 on CUDA).
    device : where the LLM runs: "auto" (default: CUDA when torch sees a GPU, else the CPU), "cpu", "cuda"
        or "cuda:N" (`ldqa.attention.device`). On CUDA the weights are bf16 (a GGUF dequantized on load;
        fp32 allowed) and attention runs on ldqa's Triton kernels; the retriever's indexes and the KV block
        store stay on the CPU (the MiniLM embedder uses CUDA whenever torch sees a GPU), and a stored block
        is reused on either device. `Answer.settings.device` says which ran.
    chat_template : "auto" (default: a model that ships a chat template, an instruct model, is prompted
        through it and its answer ends at the template's end-of-turn token; `ldqa.app.chat`) or "none"
        (every model gets the base-model prompt). `Answer.settings.chat_template` says which was used
        ("model" or "none").

    The model is checked here, cheaply (no weights read): its file or directory exists and reads, and its
    architecture (a GGUF's `general.architecture`, a directory's config.json `model_type`) is a family the
    runtime implements. The weights themselves load on first use (`warm_up`, the first answer).

    Raises
    ------
    IndexMismatchError : the store was built with another embedding model.
    ModelLoadError : the model is not found, not installed, or its file cannot be read.
    UnsupportedModelError : the model's architecture is not a supported family (the message names it and
        the supported families and weight sources).
    WeightFormatError : an unknown weight format, float16, one this torch build cannot run, or one the device
        does not run (on CUDA: bf16 or fp32).
    ValueError : an unknown device, or a CUDA device torch does not see.
    Answering raises NonFiniteLogitsError (`ldqa.attention.generate`) when the model's logits hold NaN/inf.
    """

    def __init__(self, store: str | Path | None = None, model: str | None = None, chunk_tokens: int = 256,
                 overlap_tokens: int = 32, index: str | None = None, max_new_tokens: int | None = None,
                 kv_budget_mb: int = 512, weights: str | None = None, kv_dtype: str | None = None,
                 chat_template: str = "auto", device: str = "auto"):
        from ldqa.attention.device import check_device, default_kv_dtype, resolve_device
        from ldqa.attention.loader import (DEFAULT_MODEL, check_kv_dtype, check_model_name, check_weights,
                                           default_weights)
        from ldqa.indexes.store import Store, default_store_dir
        from ldqa.retrieval.chunking import ChunkConfig
        from ldqa.retrieval.embedders import Embedder

        self.model_name = model or DEFAULT_MODEL
        check_model_name(self.model_name)  # architecture and readability now, not at the first answer
        self.device = resolve_device(check_device(device))
        self.weights = check_weights(weights or default_weights(self.model_name, self.device), device=self.device)
        self.kv_dtype = check_kv_dtype(kv_dtype or default_kv_dtype(self.device))
        from ldqa.attention.choices import prefill_gemm, prefill_weights_mode, recompute_gemm

        # a bad $LDQA_PREFILL_WEIGHTS, $LDQA_PREFILL_GEMM or $LDQA_RECOMPUTE_GEMM is refused now, not at the
        # first answer
        prefill_weights_mode()
        self.prefill_gemm = prefill_gemm(self.model_name)
        recompute_gemm(self.model_name, self.weights)
        self.chat_template = check_chat_template(chat_template)
        self._chats: dict = {}
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
        self.search_also: tuple = ()  # other collections' Stores searched with this one (`with_store`)
        from ldqa.indexes.kv_store import KVBlockStore

        self.kv_store = KVBlockStore(self.store.path / "kv", memory_budget_bytes=kv_budget_mb << 20)
        self.store.on_chunks_removed(self.kv_store.drop_chunks)  # replaced/deleted documents lose their blocks
        # Recent exact prefills (attention="full"), shared by this collection's engines: answering the same
        # prompt again (another debias method, the same question asked twice) starts from a copy.
        from ldqa.attention.context import PrefillMemo

        self.prefill_memo = PrefillMemo()
        self._engine = None

    # ----------------------------------------------------------------- ingestion
    def ingest(self, paths: str | Path | Iterable[str | Path], progress: bool = False, ray: str | None = None,
               workers: int | None = None, threads_per_worker: int = 1) -> IngestReport:
        """Load, chunk, embed and store files (directories are walked recursively): `ingest_files` under
        this collection's ingest lock (see there for statuses and errors).

        ray: None (all in this process), "local" (a new local Ray instance) or a Ray address ("auto",
        "ray://host:10001"): loading, chunking and embedding run on `workers` Ray actors of
        `threads_per_worker` threads each (`ldqa.app.ray_workers`; the files must be at the same path on
        every worker), this process writes each file as without Ray, with the same chunks and vectors.
        Raises ValueError if `paths` is empty or a Ray option is out of range; RuntimeError when Ray is
        asked for but not installed; never for a bad file (its result says why)."""
        from ldqa.app import ray_workers

        ray_workers.check_options(ray, workers, threads_per_worker)
        count = lambda text: self.tokenizer.count(text)  # noqa: E731
        with self._ingest_lock:
            if ray is None:
                return ingest_files(self.store, self.embedder, count, self.chunk_config, paths, progress)
            with ray_workers.connected(ray) as r:
                return ingest_files(self.store, self.embedder, count, self.chunk_config, paths, progress,
                                    prepare_groups=ray_workers.prepare_on_ray(r, self, workers, threads_per_worker))

    def precompute_kv(self, doc_ids: Iterable[int] | None = None, progress: bool = False, ray: str | None = None,
                      workers: int | None = None, threads_per_worker: int = 1, attention: str = "block") -> dict:
        """Encode and store the KV block of every chunk of `doc_ids` (default: all) for the current model,
        as block mode `attention` reads them (after its default anchor passages, which differ by mode), so
        the first question over them in that mode already hits the store. Returns {"blocks", "computed",
        "tokens", "bytes", "ms"}: the chunks covered, the blocks computed (the others were stored already),
        their passage tokens, the bytes they take in the KV store (tokens x the model's KV size per token in
        the store's dtype) and the wall time (ms, model loading excluded).
        ray, workers, threads_per_worker: as in `ingest`; the workers write the blocks to this store's
        ``kv/`` directory themselves, so it must be on a filesystem every worker reaches (RuntimeError
        otherwise). Raises ValueError when `attention` is not a block mode.
        """
        from ldqa.app import ray_workers

        ray_workers.check_options(ray, workers, threads_per_worker)
        _check_block_mode(attention)
        rows = self.store.get_chunks(self.store.chunk_ids(doc_ids))
        if rows:
            self.llm  # noqa: B018  (loaded before timing; on Ray a converted weight cache is written once, here)
        t0 = time.perf_counter()
        bar = progress_bar(rows, progress, "kv blocks", unit="block")
        try:
            if ray is None:
                stats = self.encode_rows(rows, on_block=bar.update if bar is not None else None, attention=attention)
                computed, tokens = stats.kv_misses, stats.tokens_computed
            else:
                with ray_workers.connected(ray) as r:
                    computed, tokens = ray_workers.precompute_on_ray(r, self, rows, workers, threads_per_worker,
                                                                     bar.update if bar is not None else None,
                                                                     attention)
        finally:
            if bar is not None:
                bar.close()
        ms = _ms(t0)
        n_bytes = tokens * self.llm.model.cfg.kv_bytes_per_token(self.kv_store.dtype) if tokens else 0
        return {"blocks": len(rows), "computed": computed, "tokens": tokens, "bytes": n_bytes, "ms": ms}

    def encode_rows(self, rows: list[dict], on_block=None, attention: str = "block"):
        """Make sure the KV block of each chunk row (`Store.get_chunks`: id, title, text, page, header) is
        in the KV block store as block mode `attention` reads it with its defaults (after its
        `DEFAULT_ANCHOR_PASSAGES` anchor passages), encoding the missing ones; on_block(1) after each.
        Returns the `PrefillStats` (kv_hits, kv_misses = blocks computed, encode_ms). Raises ValueError
        when `attention` is not a block mode."""
        from ldqa.attention.block_attention import anchor_passages_of

        _check_block_mode(attention)
        rt, tok, chat = self.block_runtime, self.llm.tokenizer, self.chat_format()
        anchor = anchor_ids(tok, anchor_passages_of(attention), None, chat)  # as the mode's answers encode them
        segs = [build_prompt(tok, [Passage(r["title"], r["text"], r["page"], r["id"], header=r["header"])], "?",
                             chat=chat) for r in rows]
        with self._generate_lock:
            return rt.encode([(s.prefix, s.passages[0], r["id"], anchor) for s, r in zip(segs, rows)],
                             on_block=on_block)

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
        other._engine = None
        other._chats = {}
        return other

    def with_store(self, store, search_also=()) -> "LongDocQA":
        """This model over another collection: a LongDocQA on `store` (a directory, created if missing, or
        an open `Store`) that shares this one's embedder, model, answer cap, exact-prefill memo and
        generation lock (one generation at a time across both; a prompt identical, token for token, to one
        prefilled for either is served from the memo), with its own KV block store (<store>/kv; this one's
        when `store` is this one's Store) and ingest lock.

        search_also: open `Store`s searched together with `store` by `retrieve`, `ask` and `stream`
        (`ldqa.app.collections.MergedRetriever`); ingest and delete act on `store` only.

        Raises IndexMismatchError when `store` was built with another embedding model.
        """
        import copy

        from ldqa.indexes.kv_store import KVBlockStore
        from ldqa.indexes.store import Store

        other = copy.copy(self)  # shallow: the model, memo and generation lock are the same objects
        if store is not self.store:
            other.store = store if isinstance(store, Store) else Store(Path(store), self.embedder.name,
                                                                       self.embedder.dim)
            other.kv_store = KVBlockStore(other.store.path / "kv",
                                          memory_budget_bytes=self.kv_store.memory_budget_bytes)
            other.store.on_chunks_removed(other.kv_store.drop_chunks)
            other._ingest_lock = threading.Lock()
        other.search_also = tuple(search_also)
        other._retriever = None
        other._engine = None
        return other

    # ----------------------------------------------------------------- models
    def chat_format(self, instruction: str | None = None):
        """The model's chat format for `instruction` (None: `ldqa.app.chat.CHAT_INSTRUCTION`), the one
        every prompt of this object is built with: a `ChatFormat`, or None when chat_template is "none" or
        the model has no chat template (then the base-model prompt, `ldqa.app.prompt.INSTRUCTION`). Raises
        ChatTemplateError (a ValueError) when the model's template cannot be rendered."""
        from ldqa.app.chat import chat_format

        if self.chat_template == "none":
            return None
        key = instruction
        if key not in self._chats:
            self._chats[key] = chat_format(self.tokenizer, CHAT_INSTRUCTION if instruction is None else instruction,
                                           f"model {self.model_name!r}")
        return self._chats[key]

    @property
    def tokenizer(self):
        from ldqa.attention.loader import load_tokenizer

        return load_tokenizer(self.model_name)

    @property
    def context_length(self) -> int:
        """The model's context window in tokens (its config's `max_position_embeddings`), which the prompt
        and the answer budget share; read from the config.json beside its tokenizer, no weights loaded.
        Raises as `tokenizer` (ModelLoadError) when the model cannot be found."""
        import json

        from ldqa.attention.config import ModelConfig

        config = Path(self.tokenizer.hf.name_or_path) / "config.json"
        return int(ModelConfig.from_hf(json.loads(config.read_text())).max_position_embeddings)

    @property
    def llm(self):
        """The loaded model (`loader.LoadedModel`), loaded on first use. Raises as `loader.load_model`, and
        WeightFormatError when its tensors were cast to float16 since (`generate.check_model_dtype`)."""
        from ldqa.attention.generate import check_model_dtype
        from ldqa.attention.loader import load_model

        lm = load_model(self.model_name, weights=self.weights, kv_dtype=self.kv_dtype, device=self.device,
                        prefill_gemm=self.prefill_gemm)
        check_model_dtype(lm.model)
        return lm

    @property
    def retriever(self):
        """The retriever of `retrieve`, `ask` and `stream`: a `Retriever` of this collection, or a
        `MergedRetriever` of it and `search_also` (created on first use)."""
        from ldqa.retrieval.retriever import Retriever

        if self._retriever is None and self.search_also:
            from ldqa.app.collections import MergedRetriever

            self._retriever = MergedRetriever([self.store, *self.search_also], self.embedder)
        elif self._retriever is None:
            self._retriever = Retriever(self.store, self.embedder)
        return self._retriever

    # ----------------------------------------------------------------- answering
    def retrieve(self, question: str, top_k: int = 5, retriever: str = "hybrid") -> list:
        """The passages `ask` would use (RetrievedPassage list, best first)."""
        _check_question(question, top_k, retriever)
        return self.retriever.search(question, top_k=top_k, mode=retriever)

    def ask(self, question: str, options: AnswerOptions | None = None, **overrides) -> Answer:
        """Answer `question` from the collection (blocking). See `stream` for the options and errors."""
        return self.stream(question, options, **overrides).result()

    def stream(self, question: str, options: AnswerOptions | None = None, **overrides) -> AnswerStream:
        """Answer `question`, streaming text pieces; `.answer` (or `.result()`) gives the Answer.

        options: an `AnswerOptions` (None: the defaults); `overrides`: its fields by name, replacing those
        of `options` (``qa.stream(q, top_k=3, attention="block")``). Each option's allowed values and
        default are in `ldqa.app.options`; what they do:
        top_k >= 1 passages from `retriever` ("hybrid" RRF of dense + BM25, "dense", "bm25");
        attention: "full" (exact attention over the whole prompt), "block" (each passage's KV states
        computed once, stored and reused, re-positioned by RoPE re-encoding; only the question and the
        passage headers are cached blocks too, unless block_headers="fresh") or "block+recompute" (block, plus
        recomputation of a `recompute_ratio` fraction of the passage tokens (default 0.3), chosen by
        `recompute_select`: "question" (the default: the tokens the question attends to most, over the whole
        context), "deviation" (CacheBlend, per passage), "lead",
        or a tuple of passage ranks recomputed whole; `ldqa.attention.choices.SELECT_METHODS`;
        block_anchors=True in block modes encodes a chunk of a long document after its document's first
        chunk, Star Attention's anchor, default `block_attention.DEFAULT_ANCHORS`) or
        "retrieval" (exact prefill, then each decode step of a global-attention layer attends to the sink,
        the recent window and the top keys an ANN index over the cached keys returns: RetrievalAttention;
        settings `top_k_keys` (an int, or "all" for exact attention), `window`, `sink`, `index`,
        `scan_fraction`, `cluster_size`, `min_indexed`, `follow` (carry-over of the previous step's best
        keys), `estimate` (the estimation zone for the keys not retrieved) of
        `ldqa.attention.retrieval_attention.RetrievalConfig`, None for its default).
        debias: "none", "calibrate" (found-in-the-middle calibrated attention intervention),
        "calibrate+reorder" (also move the most relevant passages to the best-attended slots) or "sort"
        (attention sorting); see `ldqa.attention.debias` (not with attention="retrieval"). None (the
        default): the mode's measured best, filled by `AttentionConfig.resolved` (`default_debias`: "none"
        with full attention, "calibrate+reorder" in block modes, "none" with retrieval attention;
        docs/defaults.md).
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
        max_new_tokens: the answer cap (tokens); None: this object's `max_new_tokens`.
        instruction: the prompt's instruction (default `ldqa.app.prompt.INSTRUCTION`); answer_prefix: the
        start of the answer, after "Answer:" (e.g. 'Corresponding value: "' for key-value retrieval); the
        answer's text is the model's continuation of it (see `ldqa.app.prompt.build_prompt`).
        abstain_below: when no retrieved passage has a dense cosine similarity of at least this value
        (dense and hybrid retrieval; bm25 has no such score), the answer is `prompt.ABSTAIN_PHRASE`
        ("Not found in the documents.") with the passages it looked at and no citation, and the LLM does
        not run (settings.abstained, settings.best_dense_score); None or 0 turns it off. Default
        `ABSTAIN_BELOW` (0.25, measured; see `AnswerOptions.abstain_below`).
        The prompt is counted in the model's tokens before anything is computed: the question (with the
        instruction and max_new_tokens) before retrieval, with the best passage before the abstain_below
        check; when the whole prompt and max_new_tokens do not fit the model's window, the lowest-ranked
        passages are left out (settings.passages_dropped).
        Raises ValueError (empty question; an unknown option or a value it does not allow, naming it; a
        combination the attention mode refuses), TypeError (`options` not an AnswerOptions),
        PromptTooLongError (a ValueError: the question with the instruction and max_new_tokens does not
        fit the model's window, or leaves no room for one passage), EmptyCollectionError (nothing
        ingested yet); while streaming, NonFiniteLogitsError when the model's logits hold NaN/inf (no
        empty answer is returned as if it were one: the message names the model and weight format and
        says which to use).
        """
        _check_question(question)
        o = AnswerOptions.of(options, **overrides)
        check_prompt_options(o.instruction, o.answer_prefix)
        given = o.attention_config()
        cfg = given.resolved()
        self.warm_up()  # model loading is not part of a question's timings
        budget = o.max_new_tokens or self.max_new_tokens
        self._check_budget(question, [], budget, o.instruction, o.answer_prefix)
        t0 = time.perf_counter()
        passages = self.retriever.search(question, top_k=o.top_k, mode=o.retriever)
        retrieval_ms = _ms(t0)
        self._check_budget(question, passages[:1], budget, o.instruction, o.answer_prefix)  # before the relevance check
        base = {"top_k": o.top_k, "retriever": o.retriever}
        extra = _prompt_settings(o.instruction, o.answer_prefix)
        dense = [p.dense_score for p in passages if getattr(p, "dense_score", None) is not None]
        if o.abstain_below and dense:
            extra |= {"abstain_below": float(o.abstain_below), "best_dense_score": max(dense),
                      "abstained": max(dense) < o.abstain_below}
            if extra["abstained"]:
                return self._abstention(question, passages, given, cfg.debias.method, retrieval_ms, base, extra, t0)
        return self._answer_stream(question, passages, cfg, o.max_new_tokens, retrieval_ms, base, extra, t0)

    def answer(self, question: str, passages: list, options: AnswerOptions | None = None, **overrides) -> Answer:
        """Answer `question` over given passages (no retrieval), in the given order, numbered [1]..[k].

        passages: objects with `title`, `text`, `page` (may be None) and optionally `chunk_id`, `doc_id`,
        `path`, `start`, `end` (e.g. RetrievedPassage, or `Passage` records for benchmarks). Blocks of
        passages without a chunk_id are stored but not tied to a document. options and overrides: an
        `AnswerOptions` and its fields by name, as in `stream`, less those that find passages (top_k,
        retriever, abstain_below: `SEARCH_OPTIONS`, not taken here; an `options` object's are ignored).
        Block anchors need passages of this collection (a `chunk_id` and `doc_id` it holds). Raises
        ValueError (empty question or passages, a search option given, a bad setting),
        NonFiniteLogitsError when the model's logits hold NaN/inf.
        """
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question is empty: ask something")
        if not passages:
            raise ValueError("passages is empty: give at least one passage")
        given = sorted(set(overrides) & set(SEARCH_OPTIONS))
        if given:
            raise ValueError(f"{', '.join(given)}: answer() is given its passages; {', '.join(SEARCH_OPTIONS)} "
                             "only apply to ask() and stream()")
        o = AnswerOptions.of(options, **overrides)
        cfg = o.attention_config()
        check_prompt_options(o.instruction, o.answer_prefix)
        cfg = cfg.resolved()
        passages = [p if hasattr(p, "chunk_id") else Passage.of(p) for p in passages]
        self.llm  # noqa: B018  (load before timing)
        return self._answer_stream(question, passages, cfg, o.max_new_tokens, 0.0,
                                   {"top_k": len(passages), "retriever": "given"},
                                   _prompt_settings(o.instruction, o.answer_prefix), time.perf_counter()).result()

    def _anchored(self, passages: list) -> list:
        """`passages` with `anchor` set to their document's first chunk where the passage is a later chunk
        of a document of this collection (same chunk id, document, path and text); others unchanged."""
        import dataclasses

        ids = [p.chunk_id for p in passages if getattr(p, "chunk_id", None) is not None]
        rows = {r["id"]: r for r in self.store.get_chunks(ids)}
        firsts: dict[int, str | None] = {}
        out = []
        for p in passages:
            r = rows.get(getattr(p, "chunk_id", None))
            if (r is None or r["ordinal"] == 0 or r["doc_id"] != getattr(p, "doc_id", None) or r["text"] != p.text
                    or not dataclasses.is_dataclass(p) or "anchor" not in {f.name for f in dataclasses.fields(p)}):
                out.append(p)
                continue
            if r["doc_id"] not in firsts:
                first = self.store.get_chunks(self.store.chunk_ids([r["doc_id"]])[:1])
                firsts[r["doc_id"]] = first[0]["text"] if first and first[0]["ordinal"] == 0 else None
            out.append(dataclasses.replace(p, anchor=firsts[r["doc_id"]]))
        return out

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
    def engine(self):
        """The attention engine of the current model (`ldqa.attention.engine.Engine`): builds every
        question's context; created on first use, with the collection's KV block store and prefill memo,
        and the bundled sample documents as the bias curves' calibration text."""
        from ldqa.attention.bias_curve import Calibration
        from ldqa.attention.engine import Engine

        llm = self.llm
        if self._engine is None or self._engine.llm is not llm:
            chat = self.chat_format()
            self._engine = Engine(llm, self.kv_store, self.prefill_memo,
                                  Calibration(_sample_texts, lambda ps, q: build_prompt(llm.tokenizer, ps, q, chat=chat),
                                              "chat" if chat is not None else "",
                                              lambda n: anchor_ids(llm.tokenizer, n, None, chat)))
        return self._engine

    @property
    def block_runtime(self):
        """The BlockRuntime of the current model (created, and RoPE self-checked, on first use)."""
        return self.engine.block_runtime

    def bias_curve(self, k: int, attention: str = "full", n_examples: int = 16, seed: int = 0,
                   block_headers: str | None = None, theta_scale: float = 1.0, anchor_passages: int | None = None):
        """The model's position-only attention bias for k passages (k,), in `attention` mode ("full" or a
        block mode, with `block_headers` and `anchor_passages` as in `stream`, None their defaults), from
        the bundled sample: `Engine.bias_curve` (cached on disk per model fingerprint, k, mode, n_examples,
        seed). Raises ValueError for a theta_scale other than 1 in a block mode."""
        return self.engine.bias_curve(k, attention, n_examples, seed, block_headers, theta_scale, anchor_passages)

    def _answer_stream(self, question, passages, cfg, max_new, retrieval_ms, base, extra, t0):
        """The Answer's stream for a resolved AttentionConfig `cfg`; `base` (top_k, retriever) and `extra`
        (prompt options, abstention): `Settings` keywords, beside the attention settings."""
        settings = Settings(**base, **cfg.settings(), **extra, attention=cfg.mode, model=self.model_name,
                            weights=self.weights, kv_dtype=self.kv_dtype, device=self.device,
                            chat_template="model" if self.chat_format(extra.get("instruction")) else "none")
        max_new = max_new or self.max_new_tokens
        passages = self._fit_window(question, passages, max_new, settings)
        if cfg.block.anchors:
            passages = self._anchored(passages)
        stream = AnswerStream(iter(()))
        stream._pieces = self._generate(stream, question, passages, retrieval_ms, settings, max_new, t0, cfg)
        return stream

    def _abstention(self, question, passages, given, debias, retrieval_ms, base, extra, t0) -> AnswerStream:
        """The answer when no passage is close enough to the question: ABSTAIN_PHRASE, no LLM run; the
        settings show the attention options as given (`given`, an unresolved AttentionConfig), with the
        debias method `debias` it resolves to."""
        from ldqa.app.prompt import ABSTAIN_PHRASE

        d = given.debias
        settings = Settings(**base, debias=debias, debias_orders=d.orders, debias_calibration=d.calibration,
                            debias_strength=d.strength, block_headers=given.block.headers, **extra,
                            attention=given.mode, model=self.model_name, weights=self.weights, kv_dtype=self.kv_dtype,
                            device=self.device)
        timings = Timings(retrieval_ms=retrieval_ms, stop_reason=ABSTAINED, total_ms=_ms(t0))
        stream = AnswerStream(iter([ABSTAIN_PHRASE]))
        stream.answer = Answer(question, ABSTAIN_PHRASE, [], passages, timings, settings)
        return stream

    def _check_budget(self, question, passages, max_new, instruction, answer_prefix) -> None:
        """Raise PromptTooLongError (a ValueError) when the question, with the instruction and `max_new`
        answer tokens, does not fit the model's window beside `passages` ([] for the question alone; the
        best passage after retrieval), so a question over the window is never answered "Not found"."""
        from ldqa.app.prompt import fit_passages

        llm = self.llm
        fit_passages(llm.tokenizer, passages, question, int(llm.model.cfg.max_position_embeddings), max_new,
                     instruction, answer_prefix, self.chat_format(instruction))

    def _fit_window(self, question, passages, max_new, settings) -> list:
        """The passages that fit the model's window with the question and `max_new` answer tokens (the
        lowest-ranked dropped first), recorded in `settings`. Raises PromptTooLongError (a ValueError)
        when the question cannot fit, before anything is computed."""
        from ldqa.app.prompt import fit_passages

        llm = self.llm
        window = int(llm.model.cfg.max_position_embeddings)
        kept, _, n_prompt = fit_passages(llm.tokenizer, passages, question, window, max_new,
                                         settings.instruction, settings.answer_prefix or "",
                                         self.chat_format(settings.instruction))
        settings.max_new_tokens, settings.context_length = max_new, window
        settings.passages_dropped = len(passages) - len(kept)
        if len(kept) < len(passages):
            log.warning("prompt over the model's window of %d tokens (%d reserved for the answer): %d "
                        "lowest-ranked passage(s) left out, %d kept (%d prompt tokens)", window, max_new,
                        len(passages) - len(kept), len(kept), n_prompt)
        return kept

    def _generate(self, stream: AnswerStream, question, passages, retrieval_ms, settings, max_new, t0, att_cfg):
        from ldqa.attention.generate import SamplingConfig, continue_generation
        from ldqa.attention.threads import decode_threads, prefill_on

        llm = self.llm
        chat = self.chat_format(settings.instruction)
        stop_ids = set(llm.tokenizer.eos_ids) | set(chat.stop_ids if chat else ())
        cfg = SamplingConfig(max_new_tokens=max_new, stop_strings=STOP_STRINGS + (chat.stop_strings if chat else ()))
        debias = att_cfg.debias.method
        with self._generate_lock:
            t_start = time.perf_counter()
            threads = decode_threads()
            with prefill_on(threads, llm.model):
                # block modes' anchor passages, tokenized once for every build of this answer
                anchor = anchor_ids(llm.tokenizer, settings.anchor_passages or 0, settings.instruction, chat)
                built = self.engine.context(passages, lambda ps: _build_prompt(llm.tokenizer, ps, question, settings,
                                                                               chat).with_anchor(anchor),
                                            att_cfg, max_new)
            if debias == "buckets":
                settings.bucket_scales = list(att_cfg.debias.bucket_scales)
            if built.fallback_reason:
                settings.attention_used = built.mode_used
                settings.fallback_reason = built.fallback_reason
            gen = continue_generation(built.runner, built.context.cache, built.context.logits, llm.tokenizer.decode,
                                      stop_ids, cfg, t0=t_start, threads=threads)
            for _, delta in gen:
                yield delta
            if debias == "buckets":
                built.stats.bucket_steps_chosen = list(built.runner.chosen)
        text, cited = gen.text.strip(), None
        if chat is not None:  # an instruct model's answer: the passage markers become citations, out of the text
            clean, numbers = split_citations(text)
            cited = text + " " + "".join(f"[{n}]" for n in numbers)
            text = clean or text  # an answer that is only "[2]" stays visible as such
        stream.answer = Answer(question, text, cite(cited or text, built.passages), built.passages,
                               _timings(gen.stats, retrieval_ms, _ms(t0), built), settings)


def _timings(s, retrieval_ms: float, total_ms: float, built) -> Timings:
    """`Answer.timings` of one generated answer: the generation's `GenerationStats` `s` with retrieval_ms
    and total_ms (ms), and the engine context `built`'s records: retrieval attention's `RetrievalStats`,
    the block runtime's `PrefillStats` (None for an exact prefill), the `DebiasStats`, and the time of
    the exact prefills reused from the memo (the debias recipe's sum where it keeps one, else the
    context's; 0 when none was reused)."""
    ctx, debias = built.context, built.stats
    reused = debias.reused_prefill_ms if debias is not None and debias.reused_prefill_ms is not None else \
        ctx.reused_prefill_ms
    return Timings(retrieval_ms=retrieval_ms, prefill_ms=s.prefill_ms, ttft_ms=s.ttft_ms, decode_ms=s.decode_ms,
                   tokens_per_s=s.tokens_per_s, prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens,
                   stop_reason=s.stop_reason, total_ms=total_ms,
                   retrieval_stats=built.policy.stats if built.policy is not None else None,
                   block_stats=ctx.block_stats, debias_stats=debias, reused_prefill_ms=reused)


def _check_max_new(n) -> int:
    """`n` when it is an answer cap `AnswerOptions.max_new_tokens` allows (not None); ValueError otherwise."""
    check_option("max_new_tokens", n, optional=False)
    return n


def _prompt_settings(instruction, answer_prefix) -> dict:
    """The prompt options to record in an Answer's settings (only those that differ from the default)."""
    return ({"instruction": instruction} if instruction is not None else {}) | (
        {"answer_prefix": answer_prefix} if answer_prefix else {})


def _sample_texts() -> list[str]:
    """The bundled sample documents' texts (app/sample/docs, sorted by name): the bias curves'
    calibration text. A file that does not load is skipped (logged)."""
    from ldqa.retrieval.loaders import load_document

    docs = Path(__file__).resolve().parent / "sample" / "docs"
    texts = []
    for p in sorted(docs.iterdir()) if docs.is_dir() else ():
        try:
            texts.append(load_document(p).text)
        except Exception as e:  # noqa: BLE001  (a sample file that does not load is skipped)
            log.warning("calibration: skipped %s: %s", p.name, e)
    return texts


def _build_prompt(tokenizer, passages, question, settings: Settings, chat=None):
    return build_prompt(tokenizer, passages, question, settings.instruction, settings.answer_prefix or "", chat)


def _check_question(question, top_k: int = 1, retriever: str = "hybrid") -> None:
    """Raise ValueError for an empty question, or a `top_k` or `retriever` `AnswerOptions` does not allow."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question is empty: ask something, e.g. ldqa ask \"What is ...?\"")
    check_option("top_k", top_k)
    check_option("retriever", retriever)


def _check_block_mode(attention: str) -> None:
    """ValueError naming `attention` unless it is a block mode (whose KV blocks can be precomputed)."""
    if attention not in ATTENTION_MODES or not attention.startswith("block"):
        raise ValueError(f"attention={attention!r}: KV blocks are precomputed for a block mode: "
                         f"{', '.join(m for m in ATTENTION_MODES if m.startswith('block'))}")


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000
