"""The attention engine: every way ldqa builds a question's context, behind one dispatcher.

`Engine.context(passages, build, cfg, max_new)` takes the passages in prompt order, a function that
turns passages into the prompt's token segments, one resolved `AttentionConfig` and the answer budget, and returns an `EngineContext`: the prefilled cache and next-token logits, the model
to decode with (the Transformer, or a BucketEnsemble of branches), the passages in their final order and
what building it did. One question, block attention with calibrate debiasing:

    cfg = AttentionConfig.from_kwargs(attention="block", debias="calibrate").resolved()
    engine.context(passages, build, cfg, max_new=64)
      -> debias.debiased_context(...)                      the recipe: measure, calibrate, intervene
           measure(passages)   -> Engine.build_context     block_attention.BlockRuntime.prefill
                                  + debias.passage_mass    (question's queries recorded by a DebiasKV)
           bias_curve(k)       -> Engine.bias_curve        bias_curve.estimate_bias, cached on disk
           DebiasKV(log_w) as cache.policy, question recomputed in place
      -> EngineContext(context, runner=model, passages, stats)

Modes: "full" (`context.exact_prefill`, memoized), "retrieval" (one exact pass with a `RetrievalKV`
policy serving the decode steps), "block" / "block+recompute" (`block_attention.BlockRuntime`, falling
back to full attention when its RoPE self-check failed). Debias methods: "none", "calibrate",
"calibrate+reorder", "sort" (`debias.debiased_context`) and "buckets" (`buckets.bucket_context`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ldqa.attention.bias_curve import (Calibration, bias_cache_path, curve_key, estimate_bias,
                                       load_or_estimate_bias)
from ldqa.attention.block_attention import BlockConfig, anchor_passages_of
from ldqa.attention.choices import ATTENTION_MODES, default_debias
from ldqa.attention.context import Context, PrefillMemo, exact_prefill, policy_prefill
from ldqa.attention.debias import DebiasConfig, DebiasStats
from ldqa.attention.kv_cache import CAPACITY_SLACK
from ldqa.attention.retrieval_attention import RetrievalConfig

# Block modes' two debiasing measurements (the given order and its reverse) share one pass of the question
# over both caches as a batch (`BlockRuntime.prefill_orders`); False: a pass each (the bench's baseline)
BATCH_ORDERS = True


@dataclass(frozen=True)
class AttentionConfig:
    """How a question's context is built: the attention `mode` (one of `ATTENTION_MODES`), block
    attention's settings, retrieval attention's (`RetrievalConfig`, mode "retrieval" only) and position
    debiasing's. Fields left None take their defaults in `resolved`, the one place where defaults are
    filled and combinations checked; the API, the CLI, the eval harness's cache keys and the benchmarks
    all go through it.

        AttentionConfig.from_kwargs(attention="block", debias="calibrate").resolved()
        -> AttentionConfig(mode="block", block=BlockConfig(None, "cached"), retrieval=None,
                           debias=DebiasConfig("calibrate", orders=2, calibration="ratio", strength=1.2))
    """

    mode: str = "full"
    block: BlockConfig = field(default_factory=BlockConfig)
    retrieval: RetrievalConfig | None = None
    debias: DebiasConfig = field(default_factory=DebiasConfig)

    def __post_init__(self):
        if self.mode not in ATTENTION_MODES:
            raise ValueError(f"attention={self.mode!r}: choose one of {', '.join(ATTENTION_MODES)}")

    @classmethod
    def from_kwargs(cls, attention: str = "full", recompute_ratio: float | None = None,
                    block_headers: str | None = None, debias: str | None = "none", debias_orders: int | None = None,
                    debias_calibration: str | None = None, debias_strength: float | None = None,
                    recompute_select: str | tuple[int, ...] | None = None, block_anchors: bool | None = None,
                    anchor_passages: int | None = None, **retrieval) -> "AttentionConfig":
        """The configuration from the API's flat keywords (`AnswerOptions.attention_config`'s): debias
        None is the mode's default (filled by `resolved`); `retrieval` holds `RetrievalConfig` fields
        (None values = not given; top_k_keys="all" = every key). Raises
        ValueError for an unknown mode, method or setting, a value out of range, or retrieval settings
        with another attention mode (the checks of `resolved` come on top)."""
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_MODES)}")
        if block_anchors is not None and not isinstance(block_anchors, bool):
            raise ValueError(f"block_anchors must be True, False or None, got {block_anchors!r}")
        block = BlockConfig(recompute_ratio, block_headers, recompute_select, block_anchors, anchor_passages)
        given = {k: v for k, v in retrieval.items() if v is not None}  # None = not given: the default
        rcfg = None
        if attention != "retrieval":
            if given:
                raise ValueError(f"{', '.join(sorted(given))} only apply to attention='retrieval'")
        else:
            known = set(RetrievalConfig.__dataclass_fields__)
            bad = sorted(set(given) - known)
            if bad:
                raise ValueError(f"unknown retrieval setting(s) {', '.join(bad)}: use {', '.join(sorted(known))}")
            if given.get("top_k_keys") == "all":  # every indexed key: exact attention through the same path
                given["top_k_keys"] = None
            rcfg = RetrievalConfig(**given)
        return cls(attention, block, rcfg, DebiasConfig(debias, debias_orders, debias_calibration, debias_strength))

    def resolved(self) -> "AttentionConfig":
        """This configuration with every default filled in (block settings for block modes,
        `RetrievalConfig()` for "retrieval", the mode's debias method when none is named,
        `choices.default_debias`, and that method's defaults for the mode) and knobs the mode does not
        use cleared. Raises ValueError for debiasing with attention="retrieval" and for "buckets" with
        anything but full attention."""
        d = self.debias
        if d.method is None:
            d = replace(d, method=default_debias(self.mode))
        if d.method != "none" and self.mode == "retrieval":
            raise ValueError("debias methods work with attention='full', 'block' or 'block+recompute', not "
                             "'retrieval'")
        if d.method == "buckets" and self.mode != "full":
            raise ValueError("debias='buckets' needs attention='full': stored blocks hold keys encoded with the "
                             "model's own RoPE base, and buckets change it (use 'calibrate' or 'sort' with block "
                             "modes)")
        rcfg = (self.retrieval or RetrievalConfig()) if self.mode == "retrieval" else None
        return AttentionConfig(self.mode, self.block.resolved(self.mode), rcfg, d.resolved(self.mode))

    def settings(self) -> dict:
        """The public settings keys of a resolved configuration, as `Answer.settings` shows them:
        "debias", with the calibrate methods "debias_orders", "debias_calibration", "debias_strength",
        in block modes "block_headers", with "retrieval" its `RetrievalConfig` as a dict, in
        "block+recompute" "recompute_ratio" and "recompute_select", in block modes "block_anchors" and
        "anchor_passages"."""
        d = self.debias
        out = {"debias": d.method}
        if d.calibrates:
            out |= {"debias_orders": d.orders, "debias_calibration": d.calibration, "debias_strength": d.strength}
        if self.block.headers is not None:
            out["block_headers"] = self.block.headers
        if self.block.anchors is not None:
            out["block_anchors"] = self.block.anchors
        if self.block.anchor_passages is not None:
            out["anchor_passages"] = self.block.anchor_passages
        if self.retrieval is not None:
            out["retrieval"] = asdict(self.retrieval)
        if self.block.recompute_ratio is not None:
            out["recompute_ratio"] = self.block.recompute_ratio
        if self.block.select is not None:
            out["recompute_select"] = (self.block.select if isinstance(self.block.select, str)
                                       else list(self.block.select))
        return out


@dataclass
class EngineContext:
    """What `Engine.context` returns.

    context: the prefilled Context (cache, logits (1, 1, vocab), block stats); runner: what decodes it
    (the Transformer, or a `buckets.BucketEnsemble` over the branches' caches); passages: in their final
    prompt order (the debias methods may reorder); policy: the RetrievalKV of attention="retrieval" (its
    `stats` fill while decoding) or None; mode_used: the attention mode that ran ("full" when block
    reuse is off); fallback_reason: why it is not the one asked for ("" when it is); stats: the debias
    method's `DebiasStats` (None with debias="none").
    """

    context: Context
    runner: object
    passages: list
    policy: object = None
    mode_used: str = "full"
    fallback_reason: str = ""
    stats: DebiasStats | None = None


class Engine:
    """Builds contexts for one loaded model.

    llm: a `loader.LoadedModel` (model, tokenizer, fingerprint); kv_store: the `KVBlockStore` of block
    attention (None: blocks are recomputed for every question); memo: the `PrefillMemo` of exact
    prefills (shared between engines of one collection; keys include the model's fingerprint);
    calibration: where bias curves' prompts come from (None: `bias_curve` raises RuntimeError);
    share_bucket_layers: Attention Buckets runs the layers below the first global one once for all its
    branches (same answers, bit for bit); False runs each branch's whole prefill.
    """

    def __init__(self, llm, kv_store=None, memo: PrefillMemo | None = None, calibration: Calibration | None = None,
                 share_bucket_layers: bool = True):
        self.llm = llm
        self.kv_store = kv_store
        self.memo = memo if memo is not None else PrefillMemo()
        self.calibration = calibration
        self.share_bucket_layers = share_bucket_layers
        self._block_runtime = None

    @property
    def model(self):
        return self.llm.model

    @property
    def block_runtime(self):
        """The BlockRuntime of this model (created, and RoPE self-checked, on first use)."""
        from ldqa.attention.block_attention import BlockRuntime
        from ldqa.attention.choices import recompute_gemm

        if self._block_runtime is None:
            gemm = recompute_gemm(self.llm.name, self.llm.weights)
            rt = BlockRuntime(self.llm.model, self.llm.kv_fingerprint, self.kv_store,
                              recompute_gemm=gemm.partition("+")[0], question_int8=gemm == "int8+question")
            rt.self_check()
            self._block_runtime = rt
        return self._block_runtime

    # ------------------------------------------------------------------------------ the dispatcher
    def context(self, passages: list, build, cfg: AttentionConfig, max_new: int) -> EngineContext:
        """The context of one question: `build(passages)` -> PromptSegments (the question included); `cfg`
        a resolved AttentionConfig; max_new: the answer budget (tokens) the cache makes room for. Raises
        as the model does (NonFiniteLogitsError for a block of NaN/inf)."""
        model = self.llm.model
        mode, debias = cfg.mode, cfg.debias
        out = EngineContext(None, model, passages, mode_used=mode)
        if mode.startswith("block") and not self.block_runtime.enabled:
            out.mode_used, out.fallback_reason = "full", self.block_runtime.disabled_reason
            mode = "full"
        if mode == "retrieval":
            from ldqa.attention.retrieval_attention import RetrievalKV

            out.policy = RetrievalKV(cfg.retrieval, model.cfg.attn_scale)
        if debias.method == "none" or (not passages and debias.method != "buckets"):
            # (no passage, nothing to measure or reorder: e.g. a bm25 search that matched no chunk)
            out.context = self.build_context(passages, build, mode, cfg.block, max_new, out.policy)
        elif debias.method == "buckets":
            from ldqa.attention.buckets import bucket_context

            out.context, out.runner, out.stats = bucket_context(
                model, self.llm.kv_fingerprint, build(passages), max_new, debias.bucket_scales, self.memo,
                self.share_bucket_layers)
        else:
            from ldqa.attention.debias import debiased_context

            # block+recompute measures on the plain block cache (the question's pass its selection makes),
            # then recomputes only the final order
            cheap = mode == "block+recompute"
            measured = "block" if cheap else mode

            def measure(ps):  # (block+recompute's measurements only rank: `BlockRuntime.ranking_only`)
                with self.block_runtime.ranking_only() if cheap else nullcontext():
                    return self.measure(ps, build, measured, cfg.block, max_new)

            def measure_orders(orders):  # block modes: the orders' questions in one pass
                with self.block_runtime.ranking_only() if cheap else nullcontext():
                    return self.measure_orders(orders, build, cfg.block, max_new)

            out.context, out.passages, out.stats = debiased_context(
                model, passages, debias, max_new, measure=measure,
                build=lambda ps, policy=None, scores=None: self.build_context(ps, build, mode, cfg.block, max_new,
                                                                             policy, scores=scores),
                bias_curve=lambda k: self.bias_curve(k, measured, block_headers=cfg.block.headers,
                                                     anchor_passages=cfg.block.anchor_passages or 0), rebuild=cheap,
                prompt=build if mode.startswith("block") else None,
                measure_orders=measure_orders if measured == "block" and BATCH_ORDERS else None)
        return out

    # ------------------------------------------------------------------------------ the pieces
    def build_context(self, passages: list, build, mode: str, block: BlockConfig, max_new: int, policy=None,
                      theta_scale: float = 1.0, scores=None) -> Context:
        """Prefill the prompt `build(passages)` in attention `mode` ("full"/"retrieval": one exact pass;
        "block"/"block+recompute": assembled from stored blocks with the resolved `block` settings) with
        `policy` as the cache's hook. "full" without a policy is the memoized exact prefill
        (`context.exact_prefill`, the global layers' RoPE base times `theta_scale`). scores: block+recompute's
        measured per-passage selection scores (`BlockRuntime.prefill`), or None. Returns a Context."""
        model = self.llm.model
        prompt = build(passages)
        if mode == "full" and policy is None:
            return exact_prefill(model, self.llm.kv_fingerprint, prompt, max_new, theta_scale, memo=self.memo)
        if mode in ("full", "retrieval"):
            return policy_prefill(model, prompt, max_new, policy)
        from ldqa.attention.block_attention import DEFAULT_HEADERS, DEFAULT_SELECT

        cache, logits, stats = self.block_runtime.prefill(
            prompt, [getattr(p, "chunk_id", None) for p in passages], mode=mode,
            recompute_ratio=block.recompute_ratio or 0.0, extra_capacity=max_new + CAPACITY_SLACK,
            policy=policy, headers=block.headers or DEFAULT_HEADERS, select=block.select or DEFAULT_SELECT,
            scores=scores)
        return Context(prompt, cache, logits, stats)

    def measure(self, passages: list, build, mode: str, block: BlockConfig, max_new: int, theta_scale: float = 1.0):
        """Build the context with the question's queries recorded: (Context, (k,) attention mass from the
        question to each passage, `debias.passage_mass`)."""
        from ldqa.attention.debias import DebiasKV

        model = self.llm.model
        n_q = len(build(passages[:1]).question)
        if mode == "full":  # the exact prefill records the question's queries itself
            ctx = self.build_context(passages, build, mode, block, max_new, theta_scale=theta_scale)
            queries = ctx.queries
        else:
            rec = DebiasKV(n_record=n_q, scale=model.cfg.attn_scale)
            ctx = self.build_context(passages, build, mode, block, max_new, rec)
            ctx.cache.policy = None
            queries = rec.queries
        return ctx, _measured(model, ctx, queries)

    def measure_orders(self, orders: list[list], build, block: BlockConfig, max_new: int) -> list:
        """`measure` in plain "block" mode of the same passages in several orders (position debiasing's
        two measurements), the question computed once for all of them (`BlockRuntime.prefill_orders`):
        one (Context, (k,) attention mass per slot) per order."""
        from ldqa.attention.block_attention import DEFAULT_HEADERS

        prompts = [build(ps) for ps in orders]
        built = self.block_runtime.prefill_orders(
            prompts, [[getattr(p, "chunk_id", None) for p in ps] for ps in orders],
            extra_capacity=max_new + CAPACITY_SLACK, record=True, headers=block.headers or DEFAULT_HEADERS)
        ctxs = [Context(prompt, cache, logits, stats) for prompt, (cache, logits, stats, _) in zip(prompts, built)]
        return [(ctx, _measured(self.llm.model, ctx, queries)) for ctx, (*_, queries) in zip(ctxs, built)]

    def bias_curve(self, k: int, attention: str = "full", n_examples: int = 16, seed: int = 0,
                   block_headers: str | None = None, theta_scale: float = 1.0, anchor_passages: int | None = None
                   ) -> torch.Tensor:
        """The model's position-only attention bias for k passages (k,), in `attention` mode ("full" or a
        block mode, with `block_headers`): found-in-the-middle calibration on irrelevant passages
        (`bias_curve`), computed once and cached on disk (per model fingerprint, k, mode, n_examples,
        seed). `theta_scale` (full attention only) multiplies the global layers' RoPE base, as an
        Attention Buckets branch does: where its troughs fall. `anchor_passages` (block modes): the
        blocks encoded after that many anchor passages (`Calibration.anchor`), a curve of its own; None:
        the mode's default (`anchor_passages_of`). Raises ValueError for a theta_scale other
        than 1 in a block mode (stored blocks carry the model's base), RuntimeError without calibration
        text."""
        from ldqa.attention.block_attention import DEFAULT_HEADERS, DEFAULT_RECOMPUTE_RATIO

        anchor_passages = anchor_passages_of(attention, anchor_passages)
        path = self.bias_curve_path(k, attention, n_examples, seed, block_headers, theta_scale, anchor_passages)
        # every block+recompute curve is measured at the default ratio (one curve per mode, not per ratio)
        block = BlockConfig(DEFAULT_RECOMPUTE_RATIO, block_headers or DEFAULT_HEADERS)
        cal = self.calibration

        def estimate():
            if cal is None:
                raise RuntimeError("no calibration text: give the Engine a Calibration to estimate bias curves")
            texts = cal.texts()

            anchor = []
            if anchor_passages and attention.startswith("block"):
                if cal.anchor is None:
                    raise RuntimeError(f"a bias curve with anchor_passages={anchor_passages} needs a Calibration "
                                       "with anchor ids (Calibration.anchor)")
                anchor = cal.anchor(anchor_passages)

            def measure(ps, q):
                return self.measure(ps, lambda xs: cal.build_prompt(xs, q).with_anchor(anchor), attention, block, 1,
                                    float(theta_scale))[1]

            return estimate_bias(measure, self.llm.tokenizer, k, texts, n_examples, seed)

        return load_or_estimate_bias(path, estimate)

    def bias_curve_path(self, k: int, attention: str = "full", n_examples: int = 16, seed: int = 0,
                        block_headers: str | None = None, theta_scale: float = 1.0,
                        anchor_passages: int | None = None) -> Path:
        """Where `bias_curve` caches the curve of these arguments (`bias_cache_path` under the cache root;
        its file stem is the curve's name among the bundled ones; anchor_passages None: the mode's
        default). Raises ValueError for a theta_scale other than 1 in a block mode."""
        from ldqa.attention.block_attention import DEFAULT_HEADERS
        from ldqa.attention.loader import cache_root

        if theta_scale != 1.0 and attention != "full":
            raise ValueError(f"theta_scale={theta_scale} needs attention='full', not {attention!r}")
        return bias_cache_path(cache_root(), self.llm.fingerprint, k,
                               curve_key(attention, block_headers or DEFAULT_HEADERS, theta_scale,
                                         self.calibration.layout if self.calibration is not None else "",
                                         anchor_passages_of(attention, anchor_passages)),
                               n_examples, seed)

    def clear_memo(self) -> None:
        """Forget the kept exact prefills (the next ones are computed; diagnostics timing prefills)."""
        self.memo.clear()


__all__ = ["ATTENTION_MODES", "AttentionConfig", "Engine", "EngineContext", "Context", "PrefillMemo", "Calibration"]


def _measured(model, ctx: Context, queries: dict) -> torch.Tensor:
    """The question's attention mass per passage of `ctx` (k,) from its recorded `queries` (the question
    is the prompt's last tokens in the cache); sets `ctx.token_mass`, the same per cache slot."""
    from ldqa.attention.debias import passage_mass
    from ldqa.attention.segments import passage_spans

    L, n_q = ctx.cache.length, len(ctx.prompt.question)
    mass, ctx.token_mass = passage_mass(model, ctx.cache, queries, passage_spans(ctx.prompt),
                                        torch.arange(L - n_q, L), tokens=True)
    return mass
