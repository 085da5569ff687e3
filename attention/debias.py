"""Position debiasing for multi-passage prompts (issue 6).

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
  gold ranked first at slot 1 0.88 -> 0.95; docs/results.md, issue 6, session 9). Averaging over
  orders is the idea of permutation self-consistency (Tang et al. 2023, "Found in the Middle:
  Permutation Self-Consistency Improves Listwise Ranking in Large Language Models", sec. 2).
- Both calibrate methods can calibrate in three forms (`CALIBRATION_FORMS`, default per attention mode
  `CALIBRATION`): "difference", r = a - b (found-in-the-middle), "ratio", r = a / b, or "pearson",
  r = (a - b) / sqrt(b) (the Pearson residual of observed a against expected b). If the position
  bias is multiplicative (a passage at slot s gets b_s times what its relevance earns), a - b scales
  with b_s: the relevant passage's calibrated relevance, and so its intervention weight, is larger
  where the bias is large (with two orders: at both ends) and the answers follow that U; a / b gives it
  the same weight at every slot (`STRENGTH` per form, the API's default `debias_strength`;
  docs/results.md, issue 6, session 11). With one
  order and full attention's U-shaped bias, a / b over-corrects the last slot; the Pearson residual,
  between the two (it scales with sqrt(b_s)), gives the gold passage the flattest weight across slots
  on held-out questions' recorded attention (docs/results.md, issue 6, session 12), but the answers
  follow it only in part (full, 20 passages, 200 questions: spread 10.0 -> 8.5 points; session 13).
- "sort": attention sorting, `sort_rounds` rounds: order passages by observed mass, ascending (most
  attended last), rebuild the context, measure again.
- "buckets": Attention Buckets (Chen et al. 2023, "Fortify the Shortest Stave in Attention", sec. 3):
  the prompt is prefilled once per RoPE base in `BUCKET_SCALES` (a multiplier of the global layers'
  base; sliding-window layers keep theirs), each branch's attention waveform having its troughs at
  other positions; every decode step runs all branches and the most confident one picks the token
  (`ldqa.attention.generate.BucketEnsemble`). Full attention only (stored blocks are encoded with the
  model's base). Cost: len(BUCKET_SCALES) prefills and decodes, less the layers below the first global
  layer (Gemma 3 270M: 5 of 18), which no branch's base changes and which run once for all branches.

Extra cost per question (k passages, T question tokens): "calibrate" recomputes the T question tokens
once (with orders=2 it also builds the reversed context: block modes a re-assembly, full a prefill);
the reordering methods rebuild the context once per round (full attention: a full prefill each; block
attention: re-assembly from stored blocks, a few ms plus the question). The bias curve is computed
once per (model, k, attention mode) from a calibration set built from ldqa's bundled sample documents
and question templates of our own writing, and cached on disk.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch


log = logging.getLogger(__name__)

METHODS = ("none", "calibrate", "calibrate+reorder", "sort", "buckets")
# RoPE base multipliers of the global layers, one branch each, for "buckets" (branch 0 is the model as
# trained). Not tuned: the paper searches bases per model; ours are spread in log scale around 1. Far
# smaller bases (x 0.002-0.01 of Gemma 3's 1e6) do fill each other's troughs (each puts the global layers'
# attention in a band of token distance), but on 14 NQ questions (20 passages) those branches answered by
# restating the question (25 of 42 answers) and 2 of 42 were right against 4 with no debiasing
# (docs/results.md, issue 6, session 14).
BUCKET_SCALES = (1.0, 0.5, 2.0)
# Passage orders the calibrate methods measure, per attention mode (1: the given order; 2: also the
# reversed one). Block modes re-assemble stored blocks for the second (a few hundred ms at 10 passages);
# full attention would pay a second prefill (~6 s at 10 passages on a CPU core) and meets the spread target
# with one order (docs/results.md, issue 6).
MEASURE_ORDERS = {"full": 1, "block": 2, "block+recompute": 2}
# How the calibrate methods turn measured mass a and bias b into relevance (`calibrated_relevance`), per
# attention mode: "difference" (a - b, found-in-the-middle) or "ratio" (a / b). Block: "ratio" (block
# calibrate+reorder, 200 NQ questions, spread 8.0 -> 3.5 points at 20 passages, 4.0 -> 3.0 at 10;
# block+recompute follows block, unmeasured). Full: "difference" (with one order and full attention's
# U-shaped bias, a / b over-corrects the last slot: 65 questions, spread 13.8 -> 20.0; docs/results.md,
# issue 6, session 11; "pearson", (a - b) / sqrt(b): 200 questions, spread 10.0 -> 8.5, EM +0.6 points
# (SE 0.7), not enough to change the default; session 13).
CALIBRATION_FORMS = ("difference", "ratio", "pearson")
CALIBRATION = {"full": "difference", "block": "ratio", "block+recompute": "ratio"}
# The intervention's strength per calibration form (`log_weights`). "ratio": 1.2 gives the gold passage
# of 60 held-out NQ questions (block, 20 passages, two orders) a median log-weight of 1.6-1.8 at every
# slot, what "difference" at 1.0 gives it at the ends (1.7) and more than in the middle (1.2-1.3); set
# from those questions' recorded attention (docs/data/ranking-block-20-orders2.jsonl.gz), no answers.
# "pearson": 1.0, not tuned (its weights are normalised like "difference"'s, by the mean of a / sqrt(b)).
STRENGTH = {"difference": 1.0, "ratio": 1.2, "pearson": 1.0}


def passage_spans(segments) -> list[tuple[int, int]]:
    """Cache slot ranges [start, end) of each passage (header + body) in a prompt built as `segments`
    (app.prompt.PromptSegments): prefix, then header_i + body_i, then the question."""
    spans, at = [], len(segments.prefix)
    for h, b in zip(segments.headers, segments.passages):
        spans.append((at, at + len(h) + len(b)))
        at += len(h) + len(b)
    return spans


def global_layers(cfg) -> list[int]:
    """Layers with global attention (the ones that see every passage)."""
    return [i for i, t in enumerate(cfg.layer_types) if t == "full"]


@dataclass
class DebiasKV:
    """Attention hook of the global layers (attach as `cache.policy`).

    record: keep the queries of the last `n_record` tokens of each multi-token pass (the question);
    log_w: (L,) additive score bias per cache slot (log of the attention weight), or None = no change.
    The biased attention is exact softmax attention with causal masking by position, plus log_w.
    """

    n_record: int = 0
    log_w: torch.Tensor | None = None
    scale: float = 1.0
    queries: dict = field(default_factory=dict)

    def forward(self, layer: int, q, k, v, q_pos, k_pos, slots):
        """q: (1, hq, n, d); k, v: (1, hkv, L, d); q_pos (n,), k_pos (L,). Returns (1, hq, n, d) or None
        (None: the layer runs its normal attention)."""
        if self.n_record and q.shape[2] > 1:
            self.queries[layer] = q[0, :, -self.n_record:].detach().float()  # (hq, n_record, d)
        if self.log_w is None or not bool(self.log_w.any()):
            return None  # no weights, or all zero (strength 0): exactly the layer's normal attention
        L = k.shape[2]
        bias = torch.zeros(L)
        n = min(L, self.log_w.shape[0])
        bias[:n] = self.log_w[:n]
        mask = k_pos[None, :] <= q_pos[:, None]  # (n, L) causal by position
        add = torch.where(mask, bias[None, :], torch.tensor(float("-inf")))  # (n, L)
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        qg = q.float().reshape(b, hkv, hq // hkv, nq, d)  # (b, hkv, g, n, d)
        s = torch.einsum("bhgnd,bhld->bhgnl", qg, k.float()) * self.scale + add  # (b, hkv, g, n, L)
        p = torch.softmax(s, dim=-1)
        out = torch.einsum("bhgnl,bhld->bhgnd", p, v.float())  # (b, hkv, g, n, d)
        return out.reshape(b, hq, nq, d).to(q.dtype)


def passage_mass(model, cache, queries: dict, spans, q_slots: torch.Tensor) -> torch.Tensor:
    """Attention mass from the question to each passage: (k,) float, mean over global layers, heads and
    question tokens. queries: layer -> (hq, T, d) recorded question queries at cache slots q_slots (T,)."""
    cfg = model.cfg
    masses = []
    pos = cache.positions
    for layer, q in queries.items():
        keys = cache.keys(layer)[0].float()  # (hkv, L, d)
        hkv, L, d = keys.shape
        qg = q.view(hkv, -1, q.shape[1], d)  # (hkv, g, T, d)
        s = torch.einsum("hgtd,hld->hgtl", qg, keys) * cfg.attn_scale  # (hkv, g, T, L)
        causal = pos[None, :L] <= pos[q_slots][:, None]  # (T, L)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=(0, 1, 2))  # (L,)
        masses.append(torch.stack([p[a:b].sum() for a, b in spans]))
    return torch.stack(masses).mean(0)


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


# -------------------------------------------------------------------------------------- bias curve

CALIBRATION_QUESTIONS = (  # of our own writing; none is answered by the bundled sample documents
    "Who painted the ceiling of the chapel in the old harbour town?",
    "In what year did the northern railway line first carry passengers?",
    "What is the capital of the island nation described in the atlas?",
    "How many moons does the fourth planet of the star system have?",
    "Which composer wrote the symphony first played at the spring festival?",
    "What is the boiling point of the solvent used in the experiment?",
    "Who won the chess tournament held in the mountain village?",
    "What language is spoken in the valley beyond the river delta?",
)


def calibration_passages(tokenizer, n: int, tokens: int = 120) -> list[dict]:
    """`n` irrelevant passages of about `tokens` tokens, cut from the bundled sample documents (cycled
    when the sample is short). Raises RuntimeError if the sample is missing."""
    from ldqa.retrieval.loaders import load_document

    docs = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"
    ids: list[int] = []
    for p in sorted(docs.iterdir()):
        try:
            d = load_document(p)
        except Exception as e:  # noqa: BLE001  (a sample file that does not load is skipped)
            log.warning("calibration: skipped %s: %s", p.name, e)
            continue
        ids += tokenizer.encode(d.text)
    if not ids:
        raise RuntimeError(f"no calibration text: the bundled sample documents in {docs} are missing")
    out = []
    for i in range(n):
        a = (i * tokens) % max(1, len(ids) - tokens)
        out.append({"title": f"Sample {i + 1}", "text": tokenizer.decode(ids[a:a + tokens])})
    return out


def estimate_bias(measure_fn, tokenizer, k: int, n_examples: int = 16, seed: int = 0) -> torch.Tensor:
    """The position-only bias curve (k,): mean attention mass per slot over `n_examples` prompts of k
    irrelevant passages in seeded random order. measure_fn(passages, question) -> (k,) masses.
    Deterministic for a seed."""
    rng = random.Random(seed)
    pool = calibration_passages(tokenizer, max(2 * k, k + 4))
    total = torch.zeros(k)
    for i in range(n_examples):
        passages = rng.sample(pool, k)
        q = CALIBRATION_QUESTIONS[i % len(CALIBRATION_QUESTIONS)]
        total += measure_fn(passages, q)
    return total / n_examples


def bias_cache_path(root: Path, fingerprint: str, k: int, mode: str, n_examples: int, seed: int) -> Path:
    safe = mode.replace("+", "_")
    return root / "debias" / f"{fingerprint[:16]}-k{k}-{safe}-n{n_examples}-s{seed}.json"


def load_or_estimate_bias(path: Path, estimate) -> torch.Tensor:
    """Read a cached bias curve (JSON) or compute it with `estimate()` and store it atomically."""
    if path.exists():
        try:
            return torch.tensor(json.loads(path.read_text())["bias"])
        except (ValueError, KeyError) as e:
            log.warning("bias cache %s unreadable (%s): recomputing", path, e)
    bias = estimate()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"bias": bias.tolist()}))
    tmp.replace(path)
    return bias


def uses(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"debias={method!r}: choose one of {', '.join(METHODS)}")


__all__ = ["METHODS", "MEASURE_ORDERS", "CALIBRATION_FORMS", "CALIBRATION", "STRENGTH", "DebiasKV",
           "passage_spans", "passage_mass", "calibrated_relevance", "two_order_relevance", "log_weights",
           "slot_bias", "reorder_for_bias", "sort_order", "estimate_bias"]
