"""The names the attention layer accepts, importable without torch: attention modes, position-debiasing
methods and their per-mode default, calibration forms, block header modes and block+recompute's token
selections.

The configurations that use them (`engine.AttentionConfig`, `debias.DebiasConfig`,
`block_attention.BlockConfig`) check their values against these tuples; the answering options of the
API, the CLI and the web app (`ldqa.app.options.AnswerOptions`) offer them as their allowed values, so
a name added here is offered everywhere.
"""

from __future__ import annotations

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
