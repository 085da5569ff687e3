"""The model's position-only attention bias: found-in-the-middle calibration (Hsieh et al. 2024, sec. 3).

Fill k slots with irrelevant passages in random order, ask a question none of them answers, and measure
the attention mass the question gives each slot (`debias.passage_mass`); averaged over `n_examples`
prompts, what is left is the bias of the slot itself. Full attention gives a U (first and last slots
attended most); the calibrate methods subtract (or divide by) it to read relevance from the measured
attention. With k = 3 and two examples:

    example 0: passages [p5, p1, p7], question 0 -> mass [0.31, 0.12, 0.27]
    example 1: passages [p2, p6, p0], question 1 -> mass [0.29, 0.14, 0.25]
    bias curve b = [0.30, 0.13, 0.26]

The irrelevant passages are cut from calibration text the caller passes in (`Calibration.texts`: ldqa's
app gives its bundled sample documents) and the questions are our own (`CALIBRATION_QUESTIONS`). A curve
is computed once per (model fingerprint, k, attention mode, n_examples, seed) and cached on disk
(`bias_cache_path`, a JSON file written atomically). The default model's curves at the default top_k
and Gemma 3 270M's at k = 1..10 ship with the package (`BUNDLED`, written by ``python -m
ldqa.eval.bench.bundle_bias_curves``): estimating one takes 10-60 s for Gemma 3 270M and minutes for Qwen2.5 1.5B
on a 2-core CPU, which the first debiased question of a new user would otherwise pay.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

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


@dataclass
class Calibration:
    """Where a bias curve's prompts come from: `texts()` -> the calibration documents' texts (read only
    when a curve is estimated; each tokenized on its own, then concatenated), and `build_prompt(passages,
    question)` -> the PromptSegments of a prompt over `passages` (objects with title, text, page, header)
    in the product's wording. `layout`: "" for the base-model prompt, else a name of the prompt's layout
    (e.g. "chat": the model's chat template) that keys the curves apart (`curve_key`). `anchor(n)` -> the
    ids of n generic anchor passages in that layout (`PromptSegments.with_anchor`), for block modes'
    curves with anchor passages; None: no anchors."""

    texts: Callable[[], list[str]]
    build_prompt: Callable[[list, str], object]
    layout: str = ""
    anchor: Callable[[int], list[int]] | None = None


@dataclass
class CalibrationPassage:
    """An irrelevant passage of a calibration prompt (the fields `build_prompt` reads)."""

    title: str
    text: str
    page: int | None = None
    header: str = ""


def calibration_passages(tokenizer, n: int, texts: list[str], tokens: int = 120) -> list[CalibrationPassage]:
    """`n` irrelevant passages of about `tokens` tokens, cut in turn from `texts` (each tokenized on its own,
    then concatenated; cycled when short). Raises RuntimeError when `texts` hold no tokens."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t)
    if not ids:
        raise RuntimeError("no calibration text: the calibration documents are missing or empty")
    out = []
    for i in range(n):
        a = (i * tokens) % max(1, len(ids) - tokens)
        out.append(CalibrationPassage(f"Sample {i + 1}", tokenizer.decode(ids[a:a + tokens])))
    return out


def estimate_bias(measure_fn, tokenizer, k: int, texts: list[str], n_examples: int = 16,
                  seed: int = 0) -> torch.Tensor:
    """The position-only bias curve (k,): mean attention mass per slot over `n_examples` prompts of k
    irrelevant passages (cut from `texts`) in seeded random order. measure_fn(passages, question) -> (k,)
    masses. Deterministic for a seed."""
    rng = random.Random(seed)
    pool = calibration_passages(tokenizer, max(2 * k, k + 4), texts)
    total = torch.zeros(k)
    for i in range(n_examples):
        passages = rng.sample(pool, k)
        q = CALIBRATION_QUESTIONS[i % len(CALIBRATION_QUESTIONS)]
        total += measure_fn(passages, q)
    return total / n_examples


def bias_cache_path(root: Path, fingerprint: str, k: int, mode: str, n_examples: int, seed: int) -> Path:
    """The cache file of a bias curve: root/debias/<fingerprint[:16]>-k<k>-<mode>-n<n>-s<seed>.json."""
    safe = mode.replace("+", "_")
    return root / "debias" / f"{fingerprint[:16]}-k{k}-{safe}-n{n_examples}-s{seed}.json"


BUNDLED = Path(__file__).resolve().parent / "bias_curves.json"


def bundled_curves(path: Path = BUNDLED) -> dict[str, list[float]]:
    """The bias curves shipped with ldqa: {cache file stem (`bias_cache_path`): curve}; {} when the file
    is missing or unreadable (the curves are then estimated as for any other model)."""
    try:
        return json.loads(Path(path).read_text())["curves"]
    except (OSError, ValueError, KeyError) as e:
        log.warning("bundled bias curves %s unreadable (%s): curves will be estimated", path, e)
        return {}


def load_or_estimate_bias(path: Path, estimate, bundled: Path | None = BUNDLED) -> torch.Tensor:
    """A bias curve: the cached one at `path` (JSON), else the `bundled` one of the same name (copied to
    `path`), else `estimate()`; a new curve is stored at `path` atomically."""
    if path.exists():
        try:
            return torch.tensor(json.loads(path.read_text())["bias"])
        except (ValueError, KeyError) as e:
            log.warning("bias cache %s unreadable (%s): recomputing", path, e)
    shipped = bundled_curves(bundled).get(path.stem) if bundled is not None else None
    if shipped is None:  # the first debiased question then waits for it: say so
        log.warning("estimating the position bias curve %s (once per model, weight format, passage count and "
                    "attention mode; 10 s to several minutes on a small CPU, longer for larger models)", path.stem)
    bias = torch.tensor(shipped) if shipped is not None else estimate()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one per process: two estimating at once never mix
    tmp.write_text(json.dumps({"bias": bias.tolist()}))
    tmp.replace(path)
    return bias


def curve_key(attention: str, block_headers: str, theta_scale: float = 1.0, layout: str = "",
              anchor_passages: int = 0) -> str:
    """The attention-mode part of a curve's cache name: e.g. "full", "block-cached-headers",
    "full-rope0.5", "full-chat" (`layout`: the prompt layout, "" for the base-model prompt);
    block+recompute's names carry the recipe it is measured with (the default token selection and
    ratio, e.g. "block+recompute-question0.2-cached-headers"), so a changed default measures anew; block
    modes with `anchor_passages` end in "-anchorN"."""
    if attention == "block+recompute":
        from ldqa.attention.block_attention import DEFAULT_RECOMPUTE_RATIO, DEFAULT_SELECT

        attention += f"-{DEFAULT_SELECT}{DEFAULT_RECOMPUTE_RATIO:g}"
    key = attention + (f"-{block_headers}-headers" if attention.startswith("block") else "")
    key += (f"-rope{theta_scale:g}" if theta_scale != 1.0 else "") + (f"-{layout}" if layout else "")
    return key + (f"-anchor{anchor_passages}" if anchor_passages and attention.startswith("block") else "")
