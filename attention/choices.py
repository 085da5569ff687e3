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
    return _env_choice("LDQA_PREFILL_WEIGHTS", "keep", PREFILL_WEIGHT_MODES,
                       "set it to keep (hold each layer's dequantized bf16 weight after the first prefill; faster "
                       "block modes, ~2 bytes per weight) or dequantize (dequantize in every pass; no extra memory)")


def _env_choice(var: str, default: str, allowed: tuple, advice: str) -> str:
    """$`var`, or `default` when unset or empty; ValueError "$VAR='value': `advice`" for a value not in
    `allowed`."""
    value = os.environ.get(var) or default
    if value not in allowed:
        raise ValueError(f"${var}={value!r}: {advice}")
    return value


# How a quantized layer (int8, q8_0, gguf) multiplies a prefill pass's rows (`quant.QLinear.prefill_weight`),
# from $LDQA_PREFILL_GEMM: "bf16" (default: the weight dequantized to bf16, one bf16 GEMM) or "int8" (the
# weight rounded to int8 per output channel, each row of activations to int8 with its own scale, one int8
# GEMM with int32 sums: `quant.linear_int8_rows`; W8A8 with per-token dynamic activation scales,
# SmoothQuant's per-token baseline, Xiao et al. 2023, sec. 3). Decode rows are not affected (the C
# kernels). int8 brings Qwen2.5-Coder-1.5B's 1.4K-token prefill 1.48x sooner, but its next-token KL to the
# fp32 model is 0.007 nats against bf16's 0.0006 and it changed 7 of 54 NQ-open answers (net -3.7 EM, SE
# 2.6): an opt-in (docs/results.md, "The prefill GEMM in int8").
PREFILL_GEMMS = ("bf16", "int8")


def prefill_gemm(model: str | None = None) -> str:
    """The prefill GEMM: $LDQA_PREFILL_GEMM, or "bf16" when unset (`PREFILL_GEMMS`; `model` is accepted for
    a per-model default, none differs today). Raises ValueError naming the variable for another value."""
    return _env_choice("LDQA_PREFILL_GEMM", "bf16", PREFILL_GEMMS,
                       "set it to bf16 (the default: prefill GEMMs in bf16) or int8 (int8 weights and per-token "
                       "int8 activations: a faster first token, a rounding that changes some answers)")


# block+recompute's GEMM for the passage tokens it recomputes and for its passes that only rank (the
# selection's question pass, debiasing's measurements on the plain block cache): "int8" (`quant.
# int8_lead_rows`, `quant.prefill_gemm_as`; the question's own rows stay bf16) where it was measured to keep
# the mode's accuracy and speed it up, per model and weight format (`DEFAULT_RECOMPUTE_GEMM`); "bf16"
# elsewhere. Qwen2.5-Coder-1.5B (gguf), 24 NQ-open prompts with calibrate+reorder: KL to full attention
# 0.028 against bf16's 0.030 (the recomputed tokens' own error is far larger than int8's rounding) (docs/
# results.md, "Block reuse: where the points go", "The recomputed tokens in int8"). "int8+question" also
# takes the question's rows of the final pass in int8, but the row that gives the first token at the last
# layer (`BlockRuntime.question_int8`; "The question's rows in int8").
RECOMPUTE_GEMMS = (*PREFILL_GEMMS, "int8+question")
DEFAULT_RECOMPUTE_GEMM = {("qwen2.5-coder-1.5b-instruct", "gguf"): "int8"}


def recompute_gemm(model: str, weights: str) -> str:
    """block+recompute's recompute GEMM for `model` in weight format `weights`: $LDQA_RECOMPUTE_GEMM when
    set, else `DEFAULT_RECOMPUTE_GEMM`'s, else "bf16". Raises ValueError naming the variable for a value not
    in `RECOMPUTE_GEMMS`."""
    return _env_choice("LDQA_RECOMPUTE_GEMM", DEFAULT_RECOMPUTE_GEMM.get((model, weights), "bf16"), RECOMPUTE_GEMMS,
                       "set it to int8, int8+question or bf16 (block+recompute's recomputed tokens; with "
                       "+question its question's rows too), or unset it for the model's measured default")
