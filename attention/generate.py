"""Prefill, incremental decode and sampling over ldqa's own runtime (greedy by default)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ldqa.attention.kv_cache import KVCache
from ldqa.attention.model import Transformer
from ldqa.attention.quant import WeightFormatError
from ldqa.attention.threads import DecodeThreads, timed_step
from ldqa.kernels import cpu_linear


class NonFiniteLogitsError(RuntimeError):
    """The model's next-token logits hold NaN or inf (its numbers overflowed, or its weights are damaged):
    the answer would be garbage or empty. The message names the model, its weight format and KV dtype,
    where it happened (prefill or decode step) and what to use instead."""


def _transformer(model):
    """The Transformer behind `model` (a Transformer, or a BucketEnsemble of one); None for anything else."""
    inner = getattr(model, "model", None)
    if isinstance(model, Transformer):
        return model
    return inner if isinstance(inner, Transformer) else None


def describe_model(model) -> str:
    """'model NAME (family, weights FORMAT, KV cache DTYPE)' for error messages (what the loader set)."""
    tf = _transformer(model)
    if tf is None:
        return "the model"
    kv = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(tf.kv_dtype, str(tf.kv_dtype).replace("torch.", ""))
    name = getattr(tf, "model_name", None)
    who = f"model {name!r}" if name else "the model"
    return f"{who} ({tf.cfg.family}, weights {tf.weight_format}, KV cache {kv})"


def check_finite_logits(model, logits: torch.Tensor, where: str) -> None:
    """Raise NonFiniteLogitsError when the next-token logits `logits` (vocab,) hold NaN or inf. `where`
    says when ("after the prefill of 812 prompt tokens", "at decode step 3"); the message names the model
    and says which weight formats to use.

    Cost: one sum over the vocabulary (30 us for Gemma 3's 262K logits; `isfinite(logits).all()` takes
    440 us, about as long as the argmax): a NaN or inf anywhere makes the sum non-finite, and finite
    logits cannot sum past fp32's range unless they are already absurd (|logit| > 1e33)."""
    if bool(torch.isfinite(logits.float().sum())):
        return
    tf = _transformer(model)
    fmt = tf.weight_format if tf is not None else None
    others = [f for f in ("fp32", "bf16", "int8") if f != fmt]
    raise NonFiniteLogitsError(
        f"{describe_model(model)} produced non-finite logits (NaN/inf) {where}: its activations overflowed "
        f"or its weights hold NaN/inf, so no answer can be read from them. Load it with weights "
        f"{' or '.join(repr(f) for f in others)} and kv_dtype 'fp32' (CLI: --weights {others[0]} --kv-dtype fp32); "
        "if every format fails, the model file is damaged: download it again")


def check_model_dtype(model) -> None:
    """Refuse a model whose tensors were cast to float16 (`.half()`, `.to(torch.float16)`): ldqa's runtime
    has no float16 path, and Gemma 3's activations exceed float16's range (65504), which turns its logits
    into NaN. Raises WeightFormatError naming the model and the formats to load it in instead (looks at
    the final norm, embedding, LM head and first layer: microseconds)."""
    tf = _transformer(model)
    if tf is None:
        return
    first = tf.model.layers[0] if len(tf.model.layers) else tf.model.norm
    # what .half() / .to(torch.float16) cast; not every tensor (1 ms on Gemma 3). The q8_0 format's block
    # scales are float16 by design (GGUF's layout) and are not looked at.
    buffers = [t for mod in (tf.model.embed_tokens, tf.lm_head, first)
               for name, t in mod.named_buffers() if not name.endswith("bscales")]
    probe = (tf.model.norm.weight, *first.parameters(), *buffers)
    if not any(t is not None and t.dtype == torch.float16 for t in probe):
        return
    why = ("Gemma 3's activations exceed float16's range (65504) and its logits become NaN"
           if tf.cfg.family == "gemma3" else "ldqa's runtime computes in fp32/bf16 only")
    raise WeightFormatError(f"{describe_model(model)} holds float16 tensors (cast with .half() or "
                            f".to(torch.float16)?): {why}. Do not cast it: load it with weights 'bf16' (the "
                            "size of float16, fp32's range), 'int8' or 'fp32'")


@dataclass
class SamplingConfig:
    """Decoding settings.

    max_new_tokens: cap on generated tokens; temperature: 0 = greedy (argmax), else softmax temperature;
    top_p: nucleus sampling mass (Holtzman et al. 2020), 1.0 = off; seed: RNG seed for sampling;
    stop_strings: generation stops when the decoded text contains one (it is cut off the answer).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationStats:
    """Timings of one generation. Times in ms; prompt_tokens counts the tokens prefilled."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    stop_reason: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput after the first token (tokens / s); 0 when only one token was made."""
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1000) if n > 0 and self.decode_ms > 0 else 0.0


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """Pick the next token from logits (vocab,): argmax when temperature is 0 (the C kernel's on the CPU,
    the first index on ties as torch.argmax), else top-p sampling."""
    if cfg.temperature == 0:
        return cpu_linear.argmax(logits)
    probs = torch.softmax(logits.float().cpu() / cfg.temperature, dim=-1)  # drawn on the CPU: `gen` is a CPU generator
    if cfg.top_p < 1.0:
        p_sorted, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(p_sorted, 0) - p_sorted < cfg.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], p_sorted[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass
class Generation:
    """A running generation: iterate over it for (token_id, text_delta) pairs; `stats` fills as it goes.
    `threads`: a `DecodeThreads` choosing each decode step's thread count by measurement, a fixed count, or
    None to leave torch's thread count alone (the app passes `threads.decode_threads()`)."""

    model: Transformer
    decode_fn: object
    eos_ids: set
    cfg: SamplingConfig
    cache: KVCache
    first_logits: torch.Tensor
    stats: GenerationStats
    t0: float
    token_ids: list = field(default_factory=list)
    text: str = ""
    threads: DecodeThreads | int | None = None

    def __iter__(self) -> Iterator[tuple[int, str]]:
        gen = torch.Generator().manual_seed(self.cfg.seed) if self.cfg.seed is not None else None
        logits = self.first_logits
        t_first = None
        sent = 0  # characters of self.text already yielded
        for step in range(self.cfg.max_new_tokens):
            where = f"after the prefill of {self.stats.prompt_tokens} prompt tokens" if step == 0 else \
                f"at decode step {step}"
            check_finite_logits(self.model, logits[0, -1], where)
            tok = sample(logits[0, -1], self.cfg, gen)
            if t_first is None:
                t_first = time.perf_counter()
                self.stats.ttft_ms = (t_first - self.t0) * 1000
            if tok in self.eos_ids:
                self.stats.stop_reason = "eos"
                break
            self.token_ids.append(tok)
            self.stats.generated_tokens += 1
            full = self.decode_fn(self.token_ids).lstrip()
            cut = _first_stop(full, self.cfg.stop_strings)
            if cut is not None:
                full = full[:cut]
            self.text = full
            # hold back a tail that may be the start of a stop string ("\nQues" before "tion:")
            safe = len(full) if cut is not None else len(full) - _stop_prefix_len(full, self.cfg.stop_strings)
            if safe > sent:
                yield tok, full[sent:safe]
                sent = safe
            if cut is not None:
                self.stats.stop_reason = "stop_string"
                break
            if step + 1 == self.cfg.max_new_tokens:
                self.stats.stop_reason = "max_new_tokens"
                break
            pos = torch.tensor([self.cache.next_position()])
            with timed_step(self.threads):
                logits = self.model(torch.tensor([[tok]]), pos, self.cache)
        if len(self.text) > sent:  # ended by EOS or the length cap: the held-back tail is answer text
            yield (self.token_ids[-1] if self.token_ids else -1), self.text[sent:]
        if t_first is not None:
            self.stats.decode_ms = (time.perf_counter() - t_first) * 1000


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def continue_generation(model: Transformer, cache: KVCache, logits: torch.Tensor, decode_fn, eos_ids,
                        cfg: SamplingConfig, t0: float, threads: DecodeThreads | int | None = None) -> Generation:
    """A Generation whose prompt is already in `cache` and whose next-token `logits` (1, 1, vocab) are
    known (Block-Attention's assembled prefill). TTFT counts from `t0`; threads: see `Generation`. Raises
    WeightFormatError for a model cast to float16 (`check_model_dtype`); iterating raises
    NonFiniteLogitsError when the logits of the prefill or of a decode step hold NaN/inf."""
    check_model_dtype(model)
    stats = GenerationStats(prompt_tokens=cache.length, prefill_ms=(time.perf_counter() - t0) * 1000)
    return Generation(model, decode_fn, set(eos_ids), cfg, cache, logits, stats, t0, threads=threads)


def start_generation(model: Transformer, prompt_ids: list[int], decode_fn, eos_ids, cfg: SamplingConfig,
                     cache: KVCache | None = None, prefix_len: int = 0, t0: float | None = None) -> Generation:
    """Prefill `prompt_ids` and return the Generation to iterate.

    prompt_ids: the tokens to prefill (after any `prefix_len` tokens already in `cache`, whose next
    position continues the sequence); decode_fn: list[int] -> str; eos_ids: token ids that end the answer.
    Raises ValueError on an empty prompt, WeightFormatError for a model cast to float16
    (`check_model_dtype`); iterating raises NonFiniteLogitsError when the logits of the prefill or of a
    decode step hold NaN/inf.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: nothing to prefill")
    check_model_dtype(model)
    t0 = time.perf_counter() if t0 is None else t0
    if cache is None:
        cache = model.new_cache(capacity=len(prompt_ids) + cfg.max_new_tokens + 8)
    start = cache.next_position()
    positions = torch.arange(start, start + len(prompt_ids))
    logits = model(torch.tensor([prompt_ids]), positions, cache)
    stats = GenerationStats(prompt_tokens=len(prompt_ids) + prefix_len,
                            prefill_ms=(time.perf_counter() - t0) * 1000)
    return Generation(model, decode_fn, set(eos_ids), cfg, cache, logits, stats, t0)
