"""Model configuration: one small dataclass for every supported decoder family.

Supported families (as named in Hugging Face `config.json` `model_type`): llama (Llama 3.x, SmolLM2),
qwen2 (Qwen2 / Qwen2.5: q/k/v bias), qwen3 (QK-norm, no bias), gemma3 / gemma3_text (Gemma 3: QK-norm,
(1 + w) RMSNorm, scaled embeddings, sandwich norms, sliding-window local layers with their own RoPE theta).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict

import torch

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
_ALIASES = {"gemma3_text": "gemma3", "smollm2": "llama", "mistral": None}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or RoPE variant is not one ldqa's runtime implements."""


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer.

    layer_types: per layer "full" (global causal attention, RoPE theta `rope_theta`) or "sliding"
    (causal attention over the last `sliding_window` positions, RoPE theta `rope_local_theta`).
    rope_scaling: None, {"rope_type": "linear", "factor": f} or Llama 3's
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}; all are fixed per-frequency rescalings, so cached keys can be
    re-encoded exactly.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    attention_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"model family {self.family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def attn_scale(self) -> float:
        """Multiplier of q.k: query_pre_attn_scalar ** -0.5 (Gemma) else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def theta_for(self, layer: int) -> float:
        """RoPE base of layer `layer` (Gemma 3: local layers 10K, global layers 1M)."""
        if self.layer_types[layer] == "sliding" and self.rope_local_theta:
            return self.rope_local_theta
        return self.rope_theta

    def scaling_for(self, layer: int) -> dict | None:
        """RoPE scaling of layer `layer` (Gemma 3 scales only its global layers)."""
        if self.family == "gemma3" and self.layer_types[layer] == "sliding":
            return None
        return self.rope_scaling

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V for one token across all layers (the KV cache's size per token)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (or `PretrainedConfig.to_dict()`).

        Raises UnsupportedModelError naming the architecture when it is not llama/qwen2/qwen3/gemma3, or
        when its RoPE variant cannot be reproduced (and so re-encoded) exactly.
        """
        if "text_config" in hf and hf.get("model_type") == "gemma3":
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
        mt = hf.get("model_type", "?")
        family = _ALIASES.get(mt, mt)
        if family not in SUPPORTED_FAMILIES:
            arch = ", ".join(hf.get("architectures") or []) or mt
            raise UnsupportedModelError(
                f"architecture {arch!r} (model_type {mt!r}) is not supported by ldqa's runtime; "
                f"supported families: Llama (llama), Qwen2/2.5 (qwen2), Qwen3 (qwen3), Gemma 3 (gemma3)"
            )
        n_layers = hf["num_hidden_layers"]
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rope_theta, rope_scaling, local_theta = _rope_params(hf, family)
        eos = hf.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        window = hf.get("sliding_window") if family == "gemma3" else None
        layer_types = _layer_types(hf, family, n_layers)
        if family != "gemma3" and "sliding_attention" in (hf.get("layer_types") or []):
            raise UnsupportedModelError(f"{mt}: sliding-window layers are only supported for Gemma 3")
        act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
        if family == "gemma3":
            act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_local_theta=local_theta,
            rope_scaling=rope_scaling,
            sliding_window=window,
            layer_types=layer_types,
            attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
            qk_norm=family in ("qwen3", "gemma3"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
            hidden_act=act,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if family == "gemma3" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )


def _layer_types(hf: dict, family: str, n_layers: int) -> list[str]:
    types = hf.get("layer_types")
    if types:
        return ["sliding" if t == "sliding_attention" else "full" for t in types]
    if family == "gemma3":  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = hf.get("sliding_window_pattern", 6)
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)]
    return ["full"] * n_layers


def _rope_params(hf: dict, family: str) -> tuple[float, dict | None, float | None]:
    """(global theta, global scaling, local theta) from either the v4 or the v5 config layout."""
    params = hf.get("rope_parameters")
    local_theta = hf.get("rope_local_base_freq")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta = full.get("rope_theta", hf.get("rope_theta", 10000.0))
        local_theta = local.get("rope_theta", local_theta)
        scaling = full
    elif isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or {}
    return float(theta), _check_scaling(scaling), (float(local_theta) if local_theta else None)


def _check_scaling(s: dict | None) -> dict | None:
    if not s:
        return None
    kind = s.get("rope_type") or s.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(s["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"rope_type": "llama3", **{k: float(s[k]) for k in keys}}
    raise UnsupportedModelError(
        f"RoPE variant {kind!r} is not supported (supported: default, linear, llama3); ldqa refuses RoPE "
        "variants whose cached keys it cannot re-encode exactly"
    )


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, float64, shape (head_dim // 2,).

    inv_freq[i] = theta ** (-2i / head_dim) (RoFormer, Su et al. 2021), then rescaled per `scaling`
    (linear position interpolation; Llama 3's frequency-dependent rescaling).
    """
    f = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return f
    if scaling["rope_type"] == "linear":
        return f / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / f
    smooth = (old_len / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_len / lo, f / factor, f)
    mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
