"""The names the attention layer accepts, importable without torch: attention modes, position-debiasing
methods and their per-mode default, calibration forms, block header modes and block+recompute's token
selections.

The configurations that use them (`engine.AttentionConfig`, `debias.DebiasConfig`,
`block_attention.BlockConfig`) check their values against these tuples; the answering options of the
API, the CLI and the web app (`ldqa.app.options.AnswerOptions`) offer them as their allowed values, so
a name added here is offered everywhere.
"""

from __future__ import annotations

import os

ATTENTION_MODES = ("full", "block", "block+recompute", "retrieval")
DEBIAS_METHODS = ("none", "calibrate", "calibrate+reorder", "sort", "buckets")
# What a question is debiased with when the caller names no method (`AttentionConfig.resolved`): the
# measured best of each attention mode (docs/defaults.md). Full attention: nothing (calibrate's mean paired
# gain of +1.7 points, SE 2.5, is not separable from none, F1 -7.0 on essays at top 10, and it costs
# time); block modes: calibrate+reorder (+4 points over block/none; docs/attention.md); retrieval
# attention: nothing (it cannot be debiased).
DEFAULT_DEBIAS = {"full": "none", "block": "calibrate+reorder", "block+recompute": "calibrate+reorder",
                  "retrieval": "none"}
DEBIAS_ORDERS = (1, 2)  # passage orders the calibrate methods measure: the given one, or also reversed
CALIBRATION_FORMS = ("difference", "ratio", "pearson")
HEADER_MODES = ("cached", "fresh")
SELECT_METHODS = ("question", "deviation", "lead")
# The model's formats (`loader.load_model`): how the weights are held (`quant`, docs/models.md#weight-formats)
# and the in-memory KV cache's dtype
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "q8_0", "gguf")
KV_DTYPES = ("fp32", "bf16")


def default_debias(attention: str) -> str:
    """The debias method a question in attention mode `attention` gets when the caller names none
    (`DEFAULT_DEBIAS`; "none" for a mode it does not list)."""
    return DEFAULT_DEBIAS.get(attention, "none")


# What a quantized layer does with the bf16 weight its first prefill GEMM dequantizes (`quant.QLinear.prefill_weight`),
# from $LDQA_PREFILL_WEIGHTS: "keep" (default) holds it for every later pass, about 2 bytes per weight
# (2.5 GB for Qwen2.5-Coder-1.5B, beside its 1 GB of GGUF blocks); "dequantize" dequantizes again in every
# pass. Block modes run short passes (the question; a few hundred recomputed tokens), in which dequantizing
# is up to a third of the time: kept weights bring block attention's first token 0.57 -> 0.41 s on the
# default model at 10 passages (docs/results.md, "Block reuse: where the points go"). Same results either way.
PREFILL_WEIGHT_MODES = ("keep", "dequantize")


def prefill_weights_mode() -> str:
    """$LDQA_PREFILL_WEIGHTS, or "keep" when unset (`PREFILL_WEIGHT_MODES`). Raises ValueError naming the
    variable for any other value."""
    mode = os.environ.get("LDQA_PREFILL_WEIGHTS") or "keep"
    if mode not in PREFILL_WEIGHT_MODES:
        raise ValueError(f"$LDQA_PREFILL_WEIGHTS={mode!r}: set it to keep (hold each layer's dequantized bf16 "
                         "weight after the first prefill; faster block modes, ~2 bytes per weight) or dequantize "
                         "(dequantize in every pass; no extra memory)")
    return mode
