"""The attention engine: every way ldqa builds a question's context, behind one dispatcher.

`Engine.context(passages, build, mode, settings, max_new)` takes the passages in prompt order, a
function that turns passages into the prompt's token segments, the attention mode and its settings, and
the answer budget, and returns an `EngineContext`: the prefilled cache and next-token logits, the model
to decode with (the Transformer, or a BucketEnsemble of branches), the passages in their final order and
what building it did. One question, block attention with calibrate debiasing:

    engine.context(passages, build, "block", {"debias": "calibrate", ...}, max_new=64)
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

from dataclasses import dataclass, field

import torch

from ldqa.attention.bias_curve import (Calibration, bias_cache_path, curve_key, estimate_bias,
                                       load_or_estimate_bias)
from ldqa.attention.context import CAPACITY_SLACK, Context, PrefillMemo, exact_prefill, policy_prefill


@dataclass
class EngineContext:
    """What `Engine.context` returns.

    context: the prefilled Context (cache, logits (1, 1, vocab), block stats); runner: what decodes it
    (the Transformer, or a `buckets.BucketEnsemble` over the branches' caches); passages: in their final
    prompt order (the debias methods may reorder); policy: the RetrievalKV of attention="retrieval" (its
    `stats` fill while decoding) or None; mode_used: the attention mode that ran ("full" when block
    reuse is off); fallback_reason: why it is not the one asked for ("" when it is); stats: the debias
    methods' numbers (debias_ms, debias_passes, ...; {} with debias="none").
    """

    context: Context
    runner: object
    passages: list
    policy: object = None
    mode_used: str = "full"
    fallback_reason: str = ""
    stats: dict = field(default_factory=dict)


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

        if self._block_runtime is None:
            rt = BlockRuntime(self.llm.model, self.llm.fingerprint, self.kv_store)
            rt.self_check()
            self._block_runtime = rt
        return self._block_runtime

    # ------------------------------------------------------------------------------ the dispatcher
    def context(self, passages: list, build, mode: str, settings: dict, max_new: int,
                retrieval_config=None) -> EngineContext:
        """The context of one question: `build(passages)` -> PromptSegments (the question included);
        `mode` an attention mode; `settings` the resolved attention settings ("debias", "recompute_ratio",
        "block_headers", "debias_orders", "debias_calibration", "debias_strength"; Attention Buckets adds
        "bucket_scales", the scales it ran); max_new: the answer budget (tokens) the cache makes room
        for; retrieval_config: the `RetrievalConfig` of mode "retrieval". Raises as the model does
        (NonFiniteLogitsError for a block of NaN/inf)."""
        model = self.llm.model
        debias = settings.get("debias", "none")
        out = EngineContext(None, model, passages, mode_used=mode)
        if mode.startswith("block") and not self.block_runtime.enabled:
            out.mode_used, out.fallback_reason = "full", self.block_runtime.disabled_reason
            mode = "full"
        if mode == "retrieval":
            from ldqa.attention.retrieval_attention import RetrievalKV

            out.policy = RetrievalKV(retrieval_config, model.cfg.attn_scale)
        if debias == "none":
            out.context = self.build_context(passages, build, mode, settings, max_new, out.policy)
        elif debias == "buckets":
            from ldqa.attention.buckets import bucket_context
            from ldqa.attention.debias import BUCKET_SCALES

            scales = tuple(settings.get("bucket_scales") or BUCKET_SCALES)
            out.context, out.runner, out.stats = bucket_context(
                model, self.llm.fingerprint, build(passages), max_new, scales, self.memo, self.share_bucket_layers)
            settings["bucket_scales"] = list(scales)
        else:
            from ldqa.attention.debias import debiased_context

            out.context, out.passages, out.stats = debiased_context(
                model, passages, debias, settings, max_new,
                measure=lambda ps: self.measure(ps, build, mode, settings, max_new),
                build=lambda ps: self.build_context(ps, build, mode, settings, max_new),
                bias_curve=lambda k: self.bias_curve(k, mode if mode != "retrieval" else "full",
                                                     block_headers=settings.get("block_headers")))
        return out

    # ------------------------------------------------------------------------------ the pieces
    def build_context(self, passages: list, build, mode: str, settings: dict, max_new: int, policy=None) -> Context:
        """Prefill the prompt `build(passages)` in attention `mode` ("full"/"retrieval": one exact pass;
        "block"/"block+recompute": assembled from stored blocks) with `policy` as the cache's hook.
        "full" without a policy is the memoized exact prefill (`context.exact_prefill`, at
        settings["theta_scale"], default 1). Returns a Context."""
        model = self.llm.model
        prompt = build(passages)
        if mode == "full" and policy is None:
            return exact_prefill(model, self.llm.fingerprint, prompt, max_new, settings.get("theta_scale", 1.0),
                                 memo=self.memo)
        if mode in ("full", "retrieval"):
            return policy_prefill(model, prompt, max_new, policy)
        from ldqa.attention.block_attention import DEFAULT_HEADERS

        cache, logits, stats = self.block_runtime.prefill(
            prompt, [getattr(p, "chunk_id", None) for p in passages], mode=mode,
            recompute_ratio=settings.get("recompute_ratio", 0.0), extra_capacity=max_new + CAPACITY_SLACK,
            policy=policy, headers=settings.get("block_headers") or DEFAULT_HEADERS)
        return Context(prompt, cache, logits, stats)

    def measure(self, passages: list, build, mode: str, settings: dict, max_new: int):
        """Build the context with the question's queries recorded: (Context, (k,) attention mass from the
        question to each passage, `debias.passage_mass`)."""
        from ldqa.attention.debias import DebiasKV, passage_mass
        from ldqa.attention.segments import passage_spans

        model = self.llm.model
        n_q = len(build(passages[:1]).question)
        if mode == "full":  # the exact prefill records the question's queries itself
            ctx = self.build_context(passages, build, mode, settings, max_new)
            queries = ctx.queries
        else:
            rec = DebiasKV(n_record=n_q, scale=model.cfg.attn_scale)
            ctx = self.build_context(passages, build, mode, settings, max_new, rec)
            ctx.cache.policy = None
            queries = rec.queries
        L = ctx.cache.length
        mass = passage_mass(model, ctx.cache, queries, passage_spans(ctx.prompt), torch.arange(L - n_q, L))
        return ctx, mass

    def bias_curve(self, k: int, attention: str = "full", n_examples: int = 16, seed: int = 0,
                   block_headers: str | None = None, theta_scale: float = 1.0) -> torch.Tensor:
        """The model's position-only attention bias for k passages (k,), in `attention` mode ("full" or a
        block mode, with `block_headers`): found-in-the-middle calibration on irrelevant passages
        (`bias_curve`), computed once and cached on disk (per model fingerprint, k, mode, n_examples,
        seed). `theta_scale` (full attention only) multiplies the global layers' RoPE base, as an
        Attention Buckets branch does: where its troughs fall. Raises ValueError for a theta_scale other
        than 1 in a block mode (stored blocks carry the model's base), RuntimeError without calibration
        text."""
        from ldqa.attention.block_attention import DEFAULT_HEADERS, DEFAULT_RECOMPUTE_RATIO
        from ldqa.attention.loader import cache_root

        if theta_scale != 1.0 and attention != "full":
            raise ValueError(f"theta_scale={theta_scale} needs attention='full', not {attention!r}")
        settings = {"recompute_ratio": DEFAULT_RECOMPUTE_RATIO, "block_headers": block_headers or DEFAULT_HEADERS,
                    "theta_scale": float(theta_scale)}
        path = bias_cache_path(cache_root(), self.llm.fingerprint, k,
                               curve_key(attention, settings["block_headers"], theta_scale), n_examples, seed)
        cal = self.calibration

        def estimate():
            if cal is None:
                raise RuntimeError("no calibration text: give the Engine a Calibration to estimate bias curves")
            texts = cal.texts()

            def measure(ps, q):
                return self.measure(ps, lambda xs: cal.build_prompt(xs, q), attention, settings, 1)[1]

            return estimate_bias(measure, self.llm.tokenizer, k, texts, n_examples, seed)

        return load_or_estimate_bias(path, estimate)

    def clear_memo(self) -> None:
        """Forget the kept exact prefills (the next ones are computed; diagnostics timing prefills)."""
        self.memo.clear()


__all__ = ["Engine", "EngineContext", "Context", "PrefillMemo", "Calibration"]
