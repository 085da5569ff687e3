"""What `LongDocQA` answers with: `Answer` (its text, citations and passages), its `Timings` and
`Settings`, the `AnswerStream` that yields it, and `Passage`, a passage given to `LongDocQA.answer`.
Torch-free: the renderers and the JSON form read these without loading a model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Iterator

from ldqa.app.citations import Citation

if TYPE_CHECKING:
    from ldqa.attention.block_attention import PrefillStats
    from ldqa.attention.debias import DebiasStats
    from ldqa.attention.retrieval_attention import RetrievalStats

ABSTAINED = "abstained"  # the stop reason of an answer the model was not asked for (`Timings.stop_reason`)


def repeats_itself(text: str, n: int = 4, below: float = 0.25) -> bool:
    """Whether `text` is mostly one short pattern repeated ("1000000...", "| | | |" rows): fewer than
    `below` of its character n-grams are distinct. A derailed generation looks like this; a sentence or a
    table with content does not (their n-grams are mostly distinct). Texts under 12 characters: False
    (a 16-token budget can end a derailed "100000000000000" at 15)."""
    t = text.strip()
    if len(t) < 12:
        return False
    grams = [t[i:i + n] for i in range(len(t) - n + 1)]
    return len(set(grams)) < below * len(grams)


class _ReadByKey(Mapping):
    """Read access by the keys of `to_dict` (``timings["kv_hits"]``, ``"abstained" in settings``,
    ``sorted(timings)``), for code that reads an answer's JSON form by name."""

    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


@dataclass(kw_only=True)
class Timings(_ReadByKey):
    """What one answer cost (times in ms): `Answer.timings`.

    retrieval_ms: the passage search; prefill_ms, ttft_ms (prefill + first token), decode_ms, tokens_per_s
    (decode throughput), prompt_tokens, generated_tokens, stop_reason ("eos", "stop_string",
    "max_new_tokens", or `ABSTAINED` when the model was not asked), total_ms: the generation's; the typed
    records of the attention that ran: retrieval_stats (attention="retrieval"'s `RetrievalStats`),
    block_stats (the block runtime's `PrefillStats`; None for an exact prefill, which computes every
    prompt token), debias_stats (`DebiasStats`; None without debiasing); reused_prefill_ms: the time of
    exact prefills reused from the memo (0 when none; None for an abstention, which prefills nothing).
    `to_dict` flattens them into the JSON form (keys in `Answer`'s docstring).
    """

    retrieval_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    stop_reason: str = ""
    total_ms: float = 0.0
    retrieval_stats: RetrievalStats | None = None
    block_stats: PrefillStats | None = None
    debias_stats: DebiasStats | None = None
    reused_prefill_ms: float | None = None

    @property
    def tokens_reused(self) -> int:
        """Prompt tokens whose KV states came from stored blocks (block modes; 0 otherwise)."""
        return self.block_stats.tokens_reused if self.block_stats is not None else 0

    @property
    def tokens_computed(self) -> int:
        """Prompt tokens run through the model (all of them for an exact prefill)."""
        return self.block_stats.tokens_computed if self.block_stats is not None else self.prompt_tokens

    def to_dict(self) -> dict:
        """The flat JSON form: the generation's keys, then each record's `to_dict` (retrieval attention,
        block runtime or tokens_reused/tokens_computed, debiasing), then reused_prefill_ms."""
        out = {"retrieval_ms": self.retrieval_ms, "prefill_ms": self.prefill_ms, "ttft_ms": self.ttft_ms,
               "decode_ms": self.decode_ms, "tokens_per_s": self.tokens_per_s, "prompt_tokens": self.prompt_tokens,
               "generated_tokens": self.generated_tokens, "stop_reason": self.stop_reason}
        if self.stop_reason == ABSTAINED:  # nothing prefilled: the token counts, then the total
            return out | {"tokens_reused": 0, "tokens_computed": 0, "total_ms": self.total_ms}
        out["total_ms"] = self.total_ms
        if self.retrieval_stats is not None:
            out |= self.retrieval_stats.to_dict()
        if self.block_stats is not None:
            out |= self.block_stats.to_dict()
        else:
            out |= {"tokens_reused": 0, "tokens_computed": self.prompt_tokens}
        if self.debias_stats is not None:
            out |= self.debias_stats.to_dict()
        if self.reused_prefill_ms is not None:
            out.setdefault("reused_prefill_ms", self.reused_prefill_ms)
        return out


@dataclass(kw_only=True)
class Settings(_ReadByKey):
    """What an answer was asked with, the defaults filled in: `Answer.settings`.

    top_k, retriever ("given" for `LongDocQA.answer`); the attention options (`AttentionConfig.settings`):
    debias, debias_orders / debias_calibration / debias_strength (the calibrate methods), block_headers
    and block_anchors, anchor_passages (block modes), retrieval (attention="retrieval"'s `RetrievalConfig` as a dict),
    recompute_ratio and recompute_select (block+recompute); the prompt options that differ from the
    default (instruction, answer_prefix); the abstention check (abstain_below, best_dense_score,
    abstained); attention, model, weights, kv_dtype, device ("cpu", "cuda", "cuda:N": where the LLM ran),
    chat_template ("model" or "none"); the prompt
    budget (max_new_tokens, context_length: the model's window, passages_dropped); bucket_scales
    (debias="buckets"); attention_used and fallback_reason when block reuse is off. None: does not apply
    (left out of `to_dict`, whose keys follow the field order).
    """

    top_k: int
    retriever: str
    debias: str | None = None
    debias_orders: int | None = None
    debias_calibration: str | None = None
    debias_strength: float | None = None
    block_headers: str | None = None
    instruction: str | None = None
    answer_prefix: str | None = None
    abstain_below: float | None = None
    best_dense_score: float | None = None
    abstained: bool | None = None
    attention: str
    model: str
    weights: str
    kv_dtype: str
    device: str = "cpu"
    chat_template: str | None = None
    retrieval: dict | None = None
    recompute_ratio: float | None = None
    recompute_select: str | list | None = None
    block_anchors: bool | None = None
    anchor_passages: int | None = None
    max_new_tokens: int | None = None
    context_length: int | None = None
    passages_dropped: int | None = None
    bucket_scales: list | None = None
    attention_used: str | None = None
    fallback_reason: str | None = None

    def to_dict(self) -> dict:
        """The JSON form: every field that applies (not None), in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class Answer:
    """A cited answer.

    text: the answer; citations: Citation per cited passage; passages: the retrieved passages given to
    the model, in prompt order ([1]..[k]); timings (`Timings`): retrieval_ms, prefill_ms, ttft_ms (prefill
    + first token, ms), decode_ms, tokens_per_s (decode throughput), prompt_tokens, generated_tokens, total_ms;
    settings (`Settings`): what was asked for, with the defaults filled in (top_k, retriever, attention, model,
    recompute_ratio in block+recompute, block_headers in block modes, debias, and debias_orders,
    debias_calibration and debias_strength with the calibrate methods); when block reuse is off (its
    RoPE self-check failed) `attention_used` says "full" and `fallback_reason` why. `to_dict` gives the
    JSON form, where timings is one flat dict with these keys:
    timings also has tokens_reused / tokens_computed and, in block modes, kv_hits, kv_misses,
    kv_hit_rate, assemble_ms, encode_ms (with debiasing the lookups and encode_ms are the first context
    build's, which met the store as the question found it). With `debias` other than "none": debias_ms
    and debias_passes; "calibrate" and "calibrate+reorder" add bias_curve_ms (the bias curve's lookup;
    the first question for a number of passages and an attention mode estimates it, about 16 prefills,
    and that time is also in debias_ms and ttft_ms); "calibrate",
    "calibrate+reorder" and "sort" add passage_attention (k,) (attention mass from the question to
    each passage, as last measured) and the first two calibrated_relevance (k,) and passage_weights
    (k,) (the intervention's scale per passage), and with settings.debias_orders == 2
    passage_attention_reversed (k,) (each passage's mass measured with the order reversed). These
    per-passage lists follow `passages` (the final order).
    Prompt budget: settings.context_length is the model's window (tokens) and
    settings.passages_dropped how many of the lowest-ranked passages were left out so that the prompt
    plus the answer budget (max_new_tokens) fit it (`ldqa.app.prompt.fit_passages`); `passages` holds
    only those given to the model. settings.max_new_tokens: the answer budget used; `truncated`: the
    answer stopped there (timings.stop_reason == "max_new_tokens"), not at its end.
    """

    question: str
    text: str
    citations: list[Citation]
    passages: list
    timings: Timings
    settings: Settings

    @property
    def truncated(self) -> bool:
        """Whether generation stopped at max_new_tokens (the answer may be cut short)."""
        return self.timings.stop_reason == "max_new_tokens"

    @property
    def notice(self) -> str:
        """What a reader should know about how this answer was made ("" when nothing): a cut answer, an
        abstention, an answer no passage supports, or passages left out to fit the model's window."""
        parts = []
        s = self.settings
        if self.truncated and repeats_itself(self.text):
            parts.append(f"the answer ran to max_new_tokens={s.max_new_tokens} tokens repeating "
                         "itself: the model derailed (a longer budget will not help; try --attention full, or "
                         "rephrase)")
        elif self.truncated:
            parts.append(f"the answer was cut at max_new_tokens={s.max_new_tokens} tokens "
                         "(raise max_new_tokens for a longer one)")
        if s.abstained:
            parts.append(f"no passage is close enough to the question (best similarity "
                         f"{s.best_dense_score:.2f} < {s.abstain_below}), so the model "
                         "was not asked; rephrase, or ask anyway with --abstain-below 0 (API: abstain_below=0)")
        if not s.abstained and not self.citations and self.text.strip():
            parts.append("no passage holds this answer or most of its words: it may come from the model's own "
                         "knowledge, not from the documents")
        dropped = s.passages_dropped or 0
        if dropped:
            parts.append(f"{dropped} lowest-ranked passage{'s' if dropped > 1 else ''} left out to fit the "
                         f"model's context window of {s.context_length} tokens")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        """The JSON form (`ldqa ask --json`): text, citations, passages, timings and settings as dicts,
        truncated and notice."""
        return {"question": self.question, "text": self.text,
                "citations": [c.to_dict() for c in self.citations],
                "passages": [asdict(p) for p in self.passages], "timings": self.timings.to_dict(),
                "settings": self.settings.to_dict(), "truncated": self.truncated, "notice": self.notice}


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
    anchor: str | None = None

    @classmethod
    def of(cls, obj) -> "Passage":
        if isinstance(obj, dict):
            return cls(**{k: v for k, v in obj.items() if k in cls.__dataclass_fields__})
        return cls(obj.title, obj.text, getattr(obj, "page", None), header=getattr(obj, "header", ""))
