"""Position debiasing for multi-passage prompts (docs/attention.md#position-debiasing).

Sources:
- Lost in the Middle (Liu et al. 2023): accuracy is U-shaped in the position of the relevant passage.
- Found in the Middle (Hsieh et al. 2024), section 3: the attention a passage receives is a position-
  only bias plus relevance; estimating the bias with irrelevant passages at each slot and subtracting
  it ("calibrated attention") ranks passages by relevance; section 4 uses it to intervene on attention.
- Attention Sorting (Peysakhovich & Lerer 2023): decode a step, sort the passages by the attention they
  receive (most attended last, next to the question), repeat, then answer.

What is measured: the attention mass from the question's tokens to each passage (its header + body
slots), from every global-attention layer (all layers of Llama/Qwen/SmolLM2; Gemma 3's global layers,
as its local layers cannot see most passages), averaged over query heads, question tokens and layers.
Only the question's queries are kept (a `DebiasKV` records them during the prefill pass), so the cost
is (question tokens x context) scores per global layer, never a full attention map.

Methods (`METHODS`):
- "none": nothing.
- "calibrate": found-in-the-middle calibration as an attention intervention. The calibrated relevance of
  passage p at slot s is r_p = a_p - b_s (a: observed mass, b: the model's bias curve for k passages).
  During generation (the question recomputed in place, then every decode step) the global layers add
  log w_p = strength * (r_p - mean r) / mean a to the scores of p's keys, i.e. scale p's attention by
  w_p; with equal relevance every w_p = 1 and the model is unchanged.
- "calibrate+reorder": reorder the passages so the most relevant (by r) sit at the slots the model
  attends to most (by b), rebuild the context (block mode: stored blocks, RoPE re-encoded only), then
  intervene as in "calibrate".
- Both calibrate methods can measure twice (`orders=2`, the default in block modes, `MEASURE_ORDERS`):
  in the given order and in the reversed order, r_p averaged over p's two slots (`two_order_relevance`),
  so no passage is judged only at a slot where a - b ranks poorly (block mode, 60 held-out NQ questions:
  gold ranked first at slot 1 0.88 -> 0.95; docs/results.md). Averaging over
  orders is the idea of permutation self-consistency (Tang et al. 2023, "Found in the Middle:
  Permutation Self-Consistency Improves Listwise Ranking in Large Language Models", sec. 2).
- Both calibrate methods can calibrate in three forms (`CALIBRATION_FORMS`, default per attention mode
  `CALIBRATION`): "difference", r = a - b (found-in-the-middle), "ratio", r = a / b, or "pearson",
  r = (a - b) / sqrt(b) (the Pearson residual of observed a against expected b). If the position
  bias is multiplicative (a passage at slot s gets b_s times what its relevance earns), a - b scales
  with b_s: the relevant passage's calibrated relevance, and so its intervention weight, is larger
  where the bias is large (with two orders: at both ends) and the answers follow that U; a / b gives it
  the same weight at every slot (`STRENGTH` per form, the API's default `debias_strength`;
  docs/results.md). With one order and full attention's U-shaped bias, a / b over-corrects the last
  slot; the Pearson residual, between the two (it scales with sqrt(b_s)), gives the gold passage the
  flattest weight across slots on held-out questions' recorded attention (docs/results.md), but the
  answers follow it only in part (full, 20 passages, 200 questions: spread 10.0 -> 8.5 points).
- "sort": attention sorting, `DebiasConfig.sort_rounds` rounds (default `SORT_ROUNDS`): order passages
  by observed mass, ascending (most attended last), rebuild the context, measure again.
- "buckets": Attention Buckets (Chen et al. 2023, "Fortify the Shortest Stave in Attention", sec. 3):
  the prompt is prefilled once per RoPE base in `BUCKET_SCALES` (a multiplier of the global layers'
  base; sliding-window layers keep theirs), each branch's attention waveform having its troughs at
  other positions; every decode step runs all branches and the most confident one picks the token
  (`ldqa.attention.buckets`). Full attention only (stored blocks are encoded with the
  model's base). Cost: len(BUCKET_SCALES) prefills and decodes, less the layers below the first global
  layer (Gemma 3 270M: 5 of 18), which no branch's base changes and which run once for all branches.

Extra cost per question (k passages, T question tokens): "calibrate" recomputes the T question tokens
once (with orders=2 it also builds the reversed context: block modes a re-assembly, full a prefill);
the reordering methods rebuild the context once per round (full attention: a full prefill each; block
attention: re-assembly from stored blocks, a few ms plus the question). block+recompute measures on the
plain block cache (block mode's measurement and bias curve: the question's pass over the stored blocks
that its selection makes anyway) and recomputes only the final order's context, once: 600 NQ-open
answers on the default model, calibrate+reorder +0.0 EM (SE 1.4) against full attention and +5.3 (SE 1.6)
over none, with a first token 1.4x no debiasing's (measuring on recomputed contexts: 2.9x, and no more
accurate on 120 answers; docs/results.md, "Block reuse: where the points go"). The bias curve is computed
once per (model, k, attention mode) from calibration text the caller passes in (the app: its bundled
sample documents) and question templates of our own writing, and cached on disk (`bias_curve`).

The recipe that combines these pieces for one question is `debiased_context` (at the end of this
module); `engine.Engine.context` calls it with the context builder of the attention mode.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

import torch

from ldqa.attention.choices import CALIBRATION_FORMS, DEBIAS_METHODS, DEBIAS_ORDERS
from ldqa.attention.kv_cache import CAPACITY_SLACK
from ldqa.attention.segments import passage_spans
from ldqa.attention.model import causal_plan, windowed_attention
from ldqa.kernels import cpu_linear, dispatch

log = logging.getLogger(__name__)

METHODS = DEBIAS_METHODS  # `ldqa.attention.choices`
# RoPE base multipliers of the global layers, one branch each, for "buckets" (branch 0 is the model as
# trained). Not tuned: the paper searches bases per model; ours are spread in log scale around 1. Far
# smaller bases (x 0.002-0.01 of Gemma 3's 1e6) do fill each other's troughs (each puts the global layers'
# attention in a band of token distance), but on 14 NQ questions (20 passages) those branches answered by
# restating the question (25 of 42 answers) and 2 of 42 were right against 4 with no debiasing
# (docs/results.md).
BUCKET_SCALES = (1.0, 0.5, 2.0)
# Passage orders the calibrate methods measure, per attention mode (1: the given order; 2: also the
# reversed one). Block modes re-assemble stored blocks for the second (a few hundred ms at 10 passages);
# full attention would pay a second prefill (~6 s at 10 passages on a CPU core) and meets the spread target
# with one order (docs/results.md).
MEASURE_ORDERS = {"full": 1, "block": 2, "block+recompute": 2}
# How the calibrate methods turn measured mass a and bias b into relevance (`calibrated_relevance`), per
# attention mode: "difference" (a - b, found-in-the-middle) or "ratio" (a / b). Block: "ratio" (block
# calibrate+reorder, 200 NQ questions, spread 8.0 -> 3.5 points at 20 passages, 4.0 -> 3.0 at 10;
# block+recompute follows block, unmeasured). Full: "difference" (with one order and full attention's
# U-shaped bias, a / b over-corrects the last slot: 65 questions, spread 13.8 -> 20.0; docs/results.md;
# "pearson", (a - b) / sqrt(b): 200 questions, spread 10.0 -> 8.5, EM +0.6 points (SE 0.7), not enough to
# change the default).
CALIBRATION = {"full": "difference", "block": "ratio", "block+recompute": "ratio"}
# The intervention's strength per calibration form (`log_weights`). "ratio": 1.2 gives the gold passage
# of 60 held-out NQ questions (block, 20 passages, two orders) a median log-weight of 1.6-1.8 at every
# slot, what "difference" at 1.0 gives it at the ends (1.7) and more than in the middle (1.2-1.3); set
# from those questions' recorded attention (docs/data/ranking-block-20-orders2.jsonl.gz), no answers.
# "pearson": 1.0, not tuned (its weights are normalised like "difference"'s, by the mean of a / sqrt(b)).
STRENGTH = {"difference": 1.0, "ratio": 1.2, "pearson": 1.0}


# Rounds of attention sorting ("sort"): sort by measured attention, rebuild, measure again (fewer when the
# order stops changing).
SORT_ROUNDS = 2


@dataclass(frozen=True)
class DebiasConfig:
    """Position debiasing's settings.

    method: one of `METHODS`, or None for the attention mode's default (`choices.default_debias`, filled
    by `engine.AttentionConfig.resolved`); orders (1 or 2), calibration (one of `CALIBRATION_FORMS`) and
    strength (a finite number >= 0): the calibrate methods' measurement orders, calibration form and
    intervention strength; sort_rounds: attention sorting's rounds (>= 1); bucket_scales: Attention
    Buckets' RoPE base multipliers (positive, branch 0 first). None = the default for the attention mode
    and method, filled by `resolved`. Raises ValueError naming the API's keyword (debias=, debias_orders=,
    ...) for a value out of range.
    """

    method: str | None = "none"
    orders: int | None = None
    calibration: str | None = None
    strength: float | None = None
    sort_rounds: int | None = None
    bucket_scales: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"debias={self.method!r}: choose one of {', '.join(METHODS)}")
        if self.orders is not None and (isinstance(self.orders, bool) or self.orders not in DEBIAS_ORDERS):
            raise ValueError(f"debias_orders={self.orders!r}: choose 1 (the given order) or 2 (also reversed), or "
                             "None for the default")
        if self.calibration is not None and self.calibration not in CALIBRATION_FORMS:
            raise ValueError(f"debias_calibration={self.calibration!r}: choose one of {', '.join(CALIBRATION_FORMS)}, "
                             "or None for the default")
        s = self.strength
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0):
            raise ValueError(f"debias_strength={s!r}: give a finite number >= 0 (0: no rescaling), or None for "
                             "the default (ldqa.attention.debias.STRENGTH)")
        if self.sort_rounds is not None and (isinstance(self.sort_rounds, bool) or not isinstance(self.sort_rounds, int)
                                             or self.sort_rounds < 1):
            raise ValueError(f"sort_rounds={self.sort_rounds!r}: give an int >= 1")
        if self.bucket_scales is not None and (not self.bucket_scales or any(x <= 0 for x in self.bucket_scales)):
            raise ValueError(f"bucket_scales={self.bucket_scales!r}: give one or more positive RoPE base multipliers")

    @property
    def calibrates(self) -> bool:
        """Whether the method is one of the calibrate methods (which use orders, calibration, strength)."""
        return self.method in ("calibrate", "calibrate+reorder")

    def resolved(self, mode: str) -> "DebiasConfig":
        """The settings the method runs with in attention `mode` ("full" or a block mode): the calibrate
        methods get `MEASURE_ORDERS[mode]`, `CALIBRATION[mode]` and `STRENGTH[form]` where not given,
        "sort" `SORT_ROUNDS`, "buckets" `BUCKET_SCALES`; knobs the method does not use become None
        (orders/calibration/strength given with another method are logged as ignored). Raises ValueError
        when no method is set (None: `engine.AttentionConfig.resolved` fills the mode's default first)."""
        if self.method is None:
            raise ValueError("DebiasConfig.resolved needs a method: resolve through AttentionConfig.resolved, "
                             "which fills the attention mode's default")
        if self.calibrates:
            form = self.calibration or CALIBRATION[mode]
            return DebiasConfig(self.method, self.orders or MEASURE_ORDERS[mode], form,
                                float(STRENGTH[form] if self.strength is None else self.strength))
        ignored = {k: v for k, v in (("debias_orders", self.orders), ("debias_calibration", self.calibration),
                                     ("debias_strength", self.strength)) if v is not None}
        if ignored:
            log.warning("%s: only the calibrate methods use %s; ignored with debias=%r",
                        ", ".join(f"{k}={v!r}" for k, v in ignored.items()),
                        "it" if len(ignored) == 1 else "them", self.method)
        return DebiasConfig(self.method,
                            sort_rounds=(self.sort_rounds or SORT_ROUNDS) if self.method == "sort" else None,
                            bucket_scales=tuple(self.bucket_scales or BUCKET_SCALES) if self.method == "buckets" else None)


@dataclass
class DebiasStats:
    """What debiasing did for one question (the `Answer.timings` keys of the same names).

    debias_ms: its whole time (ms; with a fresh bias curve, that estimate too); debias_passes: context
    builds (prefills or block assemblies; Attention Buckets: branches); passage_attention (k,): the mass
    from the question to each passage as last measured; reused_prefill_ms: the time of exact prefills it
    reused from the memo (ms); bias_curve_ms: the bias curve's lookup (ms); passage_weights (k,): the
    intervention's scale per passage; passage_attention_reversed (k,): each passage's mass measured in
    the reversed order (two orders); calibrated_relevance (k,); bucket_steps_chosen: per Attention
    Buckets branch, the decode steps it chose. The per-passage lists follow the final passage order;
    fields a method does not produce stay None and are left out of `to_dict`.
    """

    debias_ms: float = 0.0
    debias_passes: int = 1
    passage_attention: list[float] | None = None
    reused_prefill_ms: float | None = None
    bias_curve_ms: float | None = None
    passage_weights: list[float] | None = None
    passage_attention_reversed: list[float] | None = None
    calibrated_relevance: list[float] | None = None
    bucket_steps_chosen: list[int] | None = None

    _ORDER = ("bias_curve_ms", "passage_weights", "passage_attention_reversed", "calibrated_relevance",
              "debias_ms", "debias_passes", "passage_attention", "reused_prefill_ms", "bucket_steps_chosen")

    def to_dict(self) -> dict:
        """The set fields, in the order `Answer.timings` has always listed them."""
        return {k: getattr(self, k) for k in self._ORDER if getattr(self, k) is not None}


def global_layers(cfg) -> list[int]:
    """Layers with global attention (the ones that see every passage)."""
    return [i for i, t in enumerate(cfg.layer_types) if t == "full"]


@dataclass
class DebiasKV:
    """Attention hook of the global layers (attach as `cache.policy`).

    record: keep the queries of the last `n_record` tokens of each multi-token pass (the question) in
    `queries`, layer -> (hq, n_record, d), or (batch, hq, n_record, d) for a pass over several sequences
    (`queries_of`);
    log_w: (L,) additive score bias per cache slot (log of the attention weight), or None = no change.
    The biased attention is exact softmax attention with causal masking by position, plus log_w.
    bias_from: None (every query is biased) or a position: only queries at that position or later (the
    question and the answer) are biased; earlier ones (context tokens recomputed in the same pass, their
    positions ascending) take the layer's normal attention, so one pass can recompute context tokens and
    the question under the intervention.

    Exception to "all attention goes through `kernels.dispatch`": the biased attention is computed here
    with einsum in fp32, because no dispatch kernel takes an additive per-key bias, and it only ever
    runs for the question's T tokens (recomputed in place) and one token per decode step on the global
    layers, where its cost is (T x L) scores per layer, small next to the prefill it follows. A decode
    step on the CPU (fp32) runs ldqa's C decode attention with the bias (`cpu_linear.decode_attention`).
    """

    n_record: int = 0
    log_w: torch.Tensor | None = None
    scale: float = 1.0
    queries: dict = field(default_factory=dict)
    bias_from: int | None = None

    def forward(self, layer: int, q, k, v, q_pos, k_pos, slots):
        """q: (b, hq, n, d); k, v: (b, hkv, L, d); q_pos (n,), k_pos (L,). Returns (b, hq, n, d) or None
        (None: the layer runs its normal attention)."""
        if self.n_record and q.shape[2] > 1:
            # a copy (b, hq, n_record, d): a view would keep the whole pass's queries alive with it
            rec = q[:, :, -self.n_record:].detach().to(torch.float32, copy=True)
            self.queries[layer] = rec[0] if rec.shape[0] == 1 else rec
        if self.log_w is None:
            return None
        if self.bias_from is not None and int(q_pos[0]) < self.bias_from:
            # context tokens recomputed before the question (positions ascending): their normal attention,
            # the question's rows biased below
            n0 = int((q_pos < self.bias_from).sum())
            plan = causal_plan(q_pos[:n0], k_pos)  # groups reading the keys up to their last query
            early = (windowed_attention(q[:, :, :n0], k, v, q_pos[:n0], k_pos, None, self.scale, plan=plan)
                     if plan is not None else
                     dispatch.attention(q[:, :, :n0], k, v, mask=k_pos[None, :] <= q_pos[:n0, None], scale=self.scale))
            if n0 == q.shape[2]:
                return early
            return torch.cat([early, self.forward(layer, q[:, :, n0:], k, v, q_pos[n0:], k_pos, slots)], dim=2)
        L = k.shape[2]
        bias = self.decode_bias(L).to(k.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # (n, L) causal by position
        if q.shape[2] == 1 and cpu_linear.decode_attention_fits(q, k, v, None) and bool(mask.all()):
            # a decode step on the CPU: the C kernel with the bias added to its scores (same result)
            return cpu_linear.decode_attention(q, k, v, None, self.scale, bias)
        add = torch.where(mask, bias[None, :], float("-inf"))  # (n, L)
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        qg = q.float().reshape(b, hkv, hq // hkv, nq, d)  # (b, hkv, g, n, d)
        s = torch.einsum("bhgnd,bhld->bhgnl", qg, k.float()) * self.scale + add  # (b, hkv, g, n, L)
        p = torch.softmax(s, dim=-1)
        out = torch.einsum("bhgnl,bhld->bhgnd", p, v.float())  # (b, hkv, g, n, d)
        return out.reshape(b, hq, nq, d).to(q.dtype)

    def queries_of(self, b: int) -> dict:
        """The recorded queries of sequence `b` of the batch the pass ran: layer -> (hq, n_record, d)."""
        return {layer: q if q.dim() == 3 else q[b] for layer, q in self.queries.items()}

    def decode_bias(self, length: int) -> torch.Tensor:
        """The additive score bias of the first `length` cache slots, (length,) float32 on the CPU: log_w
        (zeros past its end, or everywhere without one). A decode step's attention under this hook is the
        layer's own plus this bias, so the one-C-call decode step (`decode_runner.CStep`) runs it."""
        bias = torch.zeros(length)
        if self.log_w is not None:
            n = min(length, self.log_w.shape[0])
            bias[:n] = self.log_w[:n].float().cpu()
        return bias


def passage_mass(model, cache, queries: dict, spans, q_slots: torch.Tensor, tokens: bool = False):
    """Attention mass from the question to each passage: (k,) float, mean over global layers, heads and
    question tokens, on the CPU. queries: layer -> (hq, T, d) recorded question queries at cache slots
    q_slots (T,). tokens: also return the same mean per cache slot, (L,) on the CPU (what the "question"
    recompute selection ranks: `block_attention.token_mass`): ((k,), (L,)).

    Computed with its own einsum, not through `kernels.dispatch` (the documented exception, as for
    `DebiasKV`): it needs the attention probabilities themselves, summed per passage span, which no
    dispatch kernel returns (they return the attention output); the scores are (hq, T, L) per global
    layer, never a full attention map."""
    cfg = model.cfg
    masses = []
    pos = cache.positions
    total = 0
    for layer, q in queries.items():
        keys = cache.keys(layer)[0].float()  # (hkv, L, d)
        hkv, L, d = keys.shape
        qg = q.view(hkv, -1, q.shape[1], d)  # (hkv, g, T, d)
        s = torch.einsum("hgtd,hld->hgtl", qg, keys) * cfg.attn_scale  # (hkv, g, T, L)
        causal = pos[None, :L] <= pos[q_slots][:, None]  # (T, L)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=(0, 1, 2))  # (L,)
        masses.append(torch.stack([p[a:b].sum() for a, b in spans]))
        total = total + p
    mass = torch.stack(masses).mean(0).cpu()  # on the CPU, with the bias curves it is compared with
    return (mass, (total / len(queries)).cpu()) if tokens else mass


def calibrated_relevance(mass: torch.Tensor, bias: torch.Tensor, form: str = "difference") -> torch.Tensor:
    """Calibrated relevance per slot, both (k,): `form` "difference": r = a - b (found-in-the-middle's
    calibration, Hsieh et al. 2024, sec. 3); "ratio": r = a / b (a multiplicative position bias: the
    attention a passage gets is its relevance scaled by its slot's bias, so r is in units of "times what an
    irrelevant passage gets there"); "pearson": r = (a - b) / sqrt(b), the Pearson residual of the observed
    mass against the bias as its expectation, between the two (a - b scales with b_s, a / b not at all,
    this with sqrt(b_s)). Raises ValueError on other shapes or forms."""
    if mass.shape != bias.shape:
        raise ValueError(f"mass {tuple(mass.shape)} and bias {tuple(bias.shape)} must both be (k,)")
    _check_form(form)
    if form == "difference":
        return mass - bias
    b = bias.clamp_min(1e-9)
    return mass / b if form == "ratio" else (mass - bias) / b.sqrt()


def two_order_relevance(mass: torch.Tensor, mass_rev: torch.Tensor, bias: torch.Tensor,
                        form: str = "difference") -> torch.Tensor:
    """Calibrated relevance from two measurements: (k,) per passage in the given order,
    r_p = (c(a_p, b_p) + c(a'_{k-1-p}, b_{k-1-p})) / 2 with c the `form`'s calibration (a - b, a / b or
    (a - b) / sqrt(b), `calibrated_relevance`), where a (k,) was measured with passage p at slot p and
    a' (k,) with the order reversed (indexed by slot: passage k-1-s at slot s); bias b (k,) by slot. Each
    passage is thus scored at two mirrored slots (Tang et al. 2023, permutation self-consistency).
    Raises ValueError unless all three are (k,), or on an unknown form."""
    if not mass.shape == mass_rev.shape == bias.shape or mass.dim() != 1:
        raise ValueError(f"mass {tuple(mass.shape)}, mass_rev {tuple(mass_rev.shape)} and bias "
                         f"{tuple(bias.shape)} must all be (k,)")
    return (calibrated_relevance(mass, bias, form) + calibrated_relevance(mass_rev, bias, form).flip(0)) / 2


def log_weights(rel: torch.Tensor, mass: torch.Tensor, strength: float | None = None,
                form: str = "difference", bias: torch.Tensor | None = None) -> torch.Tensor:
    """The intervention's log-scale per passage, (k,) from relevance `rel` (k,) of the given `form`:
    "difference": log w_p = strength * (r_p - mean r) / mean(mass) (r in attention-mass units);
    "ratio": log w_p = strength * (r_p - mean r) (r already relative);
    "pearson": log w_p = strength * (r_p - mean r) / mean(mass / sqrt(bias)) (r in sqrt-mass units), with
    mass (k,) and bias (k,) both by slot as measured. 0 for all passages when the relevance is equal.
    strength: default STRENGTH[form]. Raises ValueError on an unknown form, or "pearson" without a bias
    of mass's shape."""
    _check_form(form)
    strength = STRENGTH[form] if strength is None else strength
    centred = rel - rel.mean()
    if form == "ratio":
        return strength * centred
    if form == "pearson":
        if bias is None or bias.shape != mass.shape:
            raise ValueError(f"calibration form 'pearson' needs the bias curve by slot, shaped like mass "
                             f"{tuple(mass.shape)}; got {None if bias is None else tuple(bias.shape)}")
        return strength * centred / (mass / bias.clamp_min(1e-9).sqrt()).mean().clamp_min(1e-9)
    return strength * centred / mass.mean().clamp_min(1e-9)


def _check_form(form: str) -> None:
    if form not in CALIBRATION_FORMS:
        raise ValueError(f"calibration form {form!r}: choose one of {', '.join(CALIBRATION_FORMS)}")


def slot_bias(spans, log_w_passages: torch.Tensor, length: int) -> torch.Tensor:
    """Per-slot additive bias (length,): log_w of passage p on its span, 0 elsewhere."""
    out = torch.zeros(length)
    for (a, b), w in zip(spans, log_w_passages.tolist()):
        out[a:b] = w
    return out


def reorder_for_bias(rel: torch.Tensor, bias: torch.Tensor) -> list[int]:
    """New order (list of passage indices, slot by slot): the most relevant passage goes to the slot with
    the largest bias, the next to the next largest, and so on."""
    slots = torch.argsort(bias, descending=True).tolist()  # best-attended slot first
    ranked = torch.argsort(rel, descending=True).tolist()  # most relevant first
    order = [0] * len(rel)
    for s, p in zip(slots, ranked):
        order[s] = p
    return order


def sort_order(mass: torch.Tensor) -> list[int]:
    """Attention sorting: passages ascending by received attention (most attended last)."""
    return torch.argsort(mass, stable=True).tolist()


# ------------------------------------------------------------------------------------------ the recipe

def debiased_context(model, passages: list, cfg: DebiasConfig, max_new: int, measure, build, bias_curve,
                     rebuild: bool = False, prompt=None, measure_orders=None):
    """Position debiasing of one question's context: measure, calibrate or sort, intervene.

    model: the Transformer (its attention scale; the question is recomputed through it); passages: in
    their given order; cfg: a resolved DebiasConfig of method "calibrate", "calibrate+reorder" or "sort";
    max_new: the answer budget (tokens). The context comes from callables: measure(passages) -> (Context, (k,) attention mass
    per slot), build(passages) -> Context (no measurement), bias_curve(k) -> (k,) the position bias.
    rebuild: `measure` builds a cheaper context than `build` (block+recompute measures the question's
    attention over the plain block cache, with that mode's bias curve, as its selection pass does):
    every method ends with one `build` of the final order, intervened on where it calibrates.
    prompt: None, or prompt(passages) -> PromptSegments, and then build(passages, policy) takes a cache
    hook: a final build computes the question under the intervention in its own pass (`DebiasKV`'s
    bias_from), instead of recomputing the question after it (block modes: one pass of the question
    fewer). Without it, and where the final context was built before (the reversed order, reused), the
    question is recomputed in place under the intervention.
    measure_orders: None, or measure_orders([passages, reversed]) -> [(Context, mass), (Context, mass)],
    the two orders' measurements with the question in one pass (block modes,
    `BlockRuntime.prefill_orders`); with two orders the calibrate methods take it over two `measure` calls.

    Returns (Context ready to decode, passages in their final order, DebiasStats): debias_ms,
    debias_passes, passage_attention and reused_prefill_ms, and with the calibrate methods
    bias_curve_ms, calibrated_relevance, passage_weights and, with two orders,
    passage_attention_reversed. In block modes
    the context's block stats are the first build's lookups (what the store held before this question)
    with every build's encode_ms.
    """
    t0 = time.perf_counter()
    passes = 1
    given = list(passages)
    method = cfg.method
    paired = None  # both orders' measurements from one pass
    if measure_orders is not None and method != "sort" and cfg.orders == 2 and len(passages) > 1:
        (ctx, mass), paired = measure_orders([passages, passages[::-1]])
    else:
        ctx, mass = measure(passages)
    first = ctx  # block modes: the build that met the store as the question found it
    reused = ctx.reused_prefill_ms
    out = DebiasStats()

    def build_final(ps, policy=None, scores=None):  # one more context build, counted
        nonlocal reused, passes
        c = build(ps) if policy is None and scores is None else build(ps, policy, scores)
        reused += c.reused_prefill_ms
        passes += 1
        return c

    if method == "sort":
        for _ in range(cfg.sort_rounds):
            order = sort_order(mass)
            if order == list(range(len(passages))):
                break
            passages = [passages[i] for i in order]
            ctx, mass = measure(passages)
            reused += ctx.reused_prefill_ms
            passes += 1
        ctx.cache.policy = None
        if rebuild:
            ctx = build_final(passages)
    else:
        t_bias = time.perf_counter()
        bias = bias_curve(len(passages))
        out.bias_curve_ms = _ms(t_bias)
        k, rctx, rev = len(passages), None, None
        form = cfg.calibration
        if cfg.orders == 2 and k > 1:  # also measure in the reversed order
            rctx, mass_rev = paired or measure(passages[::-1])
            reused += rctx.reused_prefill_ms
            passes += 1
            rel = two_order_relevance(mass, mass_rev, bias, form)
            rev = mass_rev.flip(0)  # per passage, in the given order
        else:
            rel = calibrated_relevance(mass, bias, form)
        measured = mass  # by slot, as measured: what "pearson" normalises by, with bias
        final = rebuild  # the measured contexts were the cheaper mode's: build the final order's
        if method == "calibrate+reorder":
            order = reorder_for_bias(rel, bias)
            passages, rel, mass = [passages[i] for i in order], rel[order], mass[order]
            rev = rev[order] if rev is not None else None
            if not rebuild and order == list(range(k))[::-1] and rctx is not None:
                ctx = rctx  # the reversed context is already built
            elif not rebuild and order != list(range(k)):
                final = True
        log_w = log_weights(rel, measured, cfg.strength, form, bias=bias)
        intervene = bool(log_w.any())  # all zero (strength 0, equal relevance): nothing to change
        scores = None
        if rebuild and prompt is not None:  # block+recompute's selection ranks by what was measured
            scores = measured_scores(first, rctx, given, passages)
        if final and intervene and prompt is not None:  # the question computed once, under the intervention
            segments = prompt(passages)
            ctx = build_final(passages, DebiasKV(
                log_w=slot_bias(passage_spans(segments), log_w, len(segments) + max_new + CAPACITY_SLACK),
                scale=model.cfg.attn_scale, bias_from=len(segments) - len(segments.question)), scores)
            intervene = False
        elif final:
            ctx = build_final(passages, scores=scores)
        if intervene:  # the question recomputed in place under the intervention
            L = ctx.cache.length
            n_q = len(ctx.prompt.question)
            hook = DebiasKV(log_w=slot_bias(passage_spans(ctx.prompt), log_w, L + max_new + CAPACITY_SLACK),
                            scale=model.cfg.attn_scale)
            ctx.cache.policy = hook
            q_slots = torch.arange(L - n_q, L)  # the question, recomputed in place under the intervention
            ctx.logits = model(torch.tensor([ctx.prompt.question]), ctx.cache.positions[q_slots].clone(),
                               ctx.cache, slots=q_slots)
        out.passage_weights = log_w.exp().tolist()
        if rev is not None:
            out.passage_attention_reversed = rev.tolist()
        out.calibrated_relevance = rel.tolist()
    out.debias_ms, out.debias_passes, out.passage_attention, out.reused_prefill_ms = \
        _ms(t0), passes, mass.tolist(), reused
    if ctx is not first and first.block_stats is not None and ctx.block_stats is not None:
        # later builds find every block stored by the first: report what the store held before this
        # question (the first's lookups, reuse and computed tokens) and all the encoding
        fs = first.block_stats
        if rebuild:  # the final context is of another mode: its own computed tokens; of its reused ones,
            # none beyond what the store held before this question (blocks encoded by the first build are
            # not reused from the store)
            ctx.block_stats = replace(ctx.block_stats, kv_hits=fs.kv_hits, kv_misses=fs.kv_misses,
                                      tokens_reused=min(ctx.block_stats.tokens_reused, fs.tokens_reused),
                                      encode_ms=fs.encode_ms + ctx.block_stats.encode_ms)
        else:
            ctx.block_stats = replace(ctx.block_stats, kv_hits=fs.kv_hits, kv_misses=fs.kv_misses,
                                      tokens_reused=fs.tokens_reused, tokens_computed=fs.tokens_computed,
                                      encode_ms=fs.encode_ms + ctx.block_stats.encode_ms)
    return ctx, passages, out


def measured_scores(first, reversed_ctx, given: list, final: list) -> list[torch.Tensor] | None:
    """The question's attention to each slot of each passage (header and body) as measured, for
    block+recompute's selection over the final order (`BlockRuntime.prefill`'s scores): one 1-D tensor per
    passage of `final`, the mean of the measurements in the given order (`first`) and, when there is one,
    the reversed order (`reversed_ctx`), so that the slots' position bias mostly cancels, as it does in
    the passages' calibrated relevance. A header of another length in the two orders ("Passage [10]")
    is aligned by its last tokens. None when a context carries no per-slot measurement. Passages are
    matched by identity (`given` holds the objects `final` reorders)."""
    if first.token_mass is None or (reversed_ctx is not None and reversed_ctx.token_mass is None):
        return None
    k = len(given)
    spans = passage_spans(first.prompt)
    rspans = passage_spans(reversed_ctx.prompt) if reversed_ctx is not None else None
    out = []
    for p in final:
        i = next(j for j, g in enumerate(given) if g is p)
        a, b = spans[i]
        sc = first.token_mass[a:b].clone()
        if rspans is not None:
            ra, rb = rspans[k - 1 - i]
            n = min(b - a, rb - ra)
            sc[len(sc) - n:] = (sc[len(sc) - n:] + reversed_ctx.token_mass[rb - n:rb]) / 2
        out.append(sc)
    return out


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


__all__ = ["METHODS", "MEASURE_ORDERS", "CALIBRATION_FORMS", "CALIBRATION", "STRENGTH", "DebiasKV",
           "passage_spans", "passage_mass", "calibrated_relevance", "two_order_relevance", "log_weights",
           "slot_bias", "reorder_for_bias", "sort_order", "measured_scores", "DebiasConfig", "DebiasStats",
           "debiased_context"]
