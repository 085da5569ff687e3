"""A compact decoder-only transformer for the Llama, Qwen2, Qwen3 and Gemma 3 families.

Parameter names follow Hugging Face's checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...) so a
transformers state dict loads as is. Positions are explicit: `forward(tokens, positions, cache)` writes
the KV cache at those positions and masks attention by them (causal, and Gemma 3's sliding window),
which is what block-reusable KV states and RoPE re-encoding build on.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ldqa.attention.config import ModelConfig, inv_freq
from ldqa.attention.decode_runner import DecodeRunner, TorchLayers
from ldqa.attention.kv_cache import KVCache
from ldqa.attention.quant import int8_lead_active, pass_rows
from ldqa.kernels import dispatch


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32. Gemma scales by (1 + w), the others by w."""

    def __init__(self, dim: int, eps: float, plus_one: bool):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp32 = x.dtype == torch.float32  # the usual case: skip the no-op casts (a decode step runs ~110 norms)
        xf = x if fp32 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            y = xf * self._plus_one_weight()
            return y if fp32 else y.type_as(x)
        w = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        return w * xf if fp32 else w * xf.type_as(x)

    def multiplier(self) -> torch.Tensor:
        """The fp32 (dim,) vector the normalized input is multiplied by: 1 + w (Gemma) or w."""
        return self._plus_one_weight() if self.plus_one else self.weight.float()

    def _plus_one_weight(self) -> torch.Tensor:
        """1 + w in fp32, computed once per version of the weight (the same values as computing it each call)."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if getattr(self, "_p1_key", None) != key:
            self._p1, self._p1_key = 1.0 + w.float(), key
        return self._p1


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
    """cos, sin of RoPE angles: positions (n,) int -> two (n, head_dim) tensors (angles in float64).

    Layout is Hugging Face's "rotate_half": frequency i drives dimensions i and i + head_dim/2.
    """
    ang = positions.to(torch.float64)[:, None] * freqs[None, :]  # (n, head_dim/2)
    ang = torch.cat([ang, ang], dim=-1)  # (n, head_dim)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: (batch, heads, n, head_dim) by angles cos/sin: (n, head_dim) (rotate_half layout)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool mask (q_len, k_len), True where query i may attend to key j.

    Causal by position (k_pos[j] <= q_pos[i]); with `window`, also q_pos[i] - k_pos[j] < window
    (Gemma 3 local layers: a query at position p sees p - window + 1 .. p). Example, positions 0..3,
    window 2:  row p=2 -> keys 1, 2;  row p=3 -> keys 2, 3.
    """
    diff = q_pos[:, None] - k_pos[None, :]  # (q_len, k_len)
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def _ascending(pos: torch.Tensor) -> bool:
    return pos.numel() < 2 or bool((pos[1:] > pos[:-1]).all())


def _plain_prompt(q_pos: torch.Tensor, k_pos: torch.Tensor, masks: dict) -> bool:
    """Whether the queries are the keys at ascending positions 0.., a prompt into an empty cache (the
    kernels' default positions then say the same as these): decided once per forward pass (`masks`)."""
    if "plain_prompt" not in masks:
        n = q_pos.shape[0]
        masks["plain_prompt"] = (q_pos.shape == k_pos.shape and int(q_pos[0]) == 0 and int(q_pos[-1]) == n - 1
                                 and _ascending(q_pos) and torch.equal(q_pos, k_pos))  # = arange(n)
    return masks["plain_prompt"]


def window_plan(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, max_queries: int = 512) -> list:
    """Query groups of `windowed_attention`: (q_start, q_end, k_lo, k_hi, mask or None) per group.
    window None: causal by position only, groups of `max_queries` queries each reading the keys up to
    its last query's position.

    Depends only on positions, so one forward pass computes it once for all its layers of one kind.
    """
    pos = q_pos.tolist()
    starts = [0]
    for i in range(1, len(pos)):
        if (window is not None and pos[i] - pos[starts[-1]] >= window) or i - starts[-1] >= max_queries:
            starts.append(i)
    plan = []
    for a, b_ in zip(starts, starts[1:] + [len(pos)]):
        qp = q_pos[a:b_]
        lo = 0 if window is None else int(torch.searchsorted(k_pos, qp[0] - window + 1))
        hi = int(torch.searchsorted(k_pos, qp[-1], right=True))
        m = attention_mask(qp, k_pos[lo:hi], window)
        plan.append((a, b_, lo, hi, None if bool(m.all()) else m))
    return plan


# Queries per group of a global layer's attention when the queries are scattered through the cache
# (tokens recomputed in place): each group reads the keys up to its last query, so the masked work
# shrinks from n x L towards the triangle (`causal_plan`)
CAUSAL_GROUP = 32


def causal_plan(q_pos: torch.Tensor, k_pos: torch.Tensor) -> list | None:
    """`window_plan` for attention causal by position (no window) in groups of CAUSAL_GROUP queries, or
    None when it would not pay: positions not ascending, or a single group."""
    if q_pos.numel() <= CAUSAL_GROUP or not (_ascending(q_pos) and _ascending(k_pos)):
        return None
    return window_plan(q_pos, k_pos, None, CAUSAL_GROUP)


def windowed_attention(q, k, v, q_pos, k_pos, window: int | None, scale: float, max_queries: int = 512,
                       plan: list | None = None):
    """Sliding-window attention that reads, for each group of queries, only the keys inside the group's
    windows. Exact (same result as masking the whole key range).

    q: (b, h, n, d) with ascending positions q_pos (n,); k, v: (b, kv_heads, L, d) with ascending k_pos
    (L,). Queries are grouped while the group's positions span less than `window` (and at most
    `max_queries`); a group at positions [p0, p1] reads the keys with positions in [p0 - window + 1, p1].
    Example, window 4, queries at 10, 11, 30: groups {10, 11} -> keys 7..11, {30} -> keys 27..30.
    window None: causal only, a group reads the keys up to p1 (queries scattered through a cache, as
    recomputed tokens are: about half the masked work of reading every key).
    plan: a precomputed `window_plan` for these positions (else computed here).
    A prefill of n tokens then costs about n * 2 * window key reads per layer instead of n^2 / 2; fresh
    tokens scattered through a reused Block-Attention cache read a few windows instead of everything.
    """
    outs = []
    for a, b_, lo, hi, m in plan or window_plan(q_pos, k_pos, window, max_queries):
        outs.append(dispatch.attention(q[:, :, a:b_], k[:, :, lo:hi], v[:, :, lo:hi], mask=m, scale=scale))
    return torch.cat(outs, dim=2)  # (b, h, n, d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            plus_one = cfg.family == "gemma3"
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, plus_one)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, plus_one)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: (batch, n, hidden) -> q (batch, heads, n, d), k, v (batch, kv_heads, n, d), RoPE applied."""
        return self.project_q(x, cos, sin), *self.project_kv(x, cos, sin)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`project`'s queries alone: x (batch, n, hidden) -> q (batch, heads, n, d), RoPE applied."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, -1, self.cfg.head_dim).transpose(1, 2)
        if self.cfg.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`project` without the queries: x (batch, n, hidden) -> k, v (batch, kv_heads, n, d), RoPE applied."""
        b, n, _ = x.shape
        d = self.cfg.head_dim
        k = self.k_proj(x).view(b, n, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, d).transpose(1, 2)
        if self.cfg.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, positions, cache: KVCache | None, masks: dict, slots=None,
                q_last: int | None = None):
        """x: (batch, n, hidden) -> (batch, n, hidden): project, attend (writing the cache), o_proj.
        q_last: only the last q_last rows query (their output, (batch, q_last, hidden)); every row's K/V
        is still computed and written."""
        if q_last is None:
            q, k, v = self.project(x, cos, sin)
        else:
            k, v = self.project_kv(x, cos, sin)
            q = self.project_q(x[:, -q_last:], cos[-q_last:], sin[-q_last:])
        out = self.attend(q, k, v, positions, cache, masks, slots, q_last)  # (b, h, n, d)
        b, h, n, d = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, h * d))

    def attend(self, q, k, v, positions, cache: KVCache | None, masks: dict, slots=None,
               q_last: int | None = None) -> torch.Tensor:
        """Attention of this layer's new q (batch, heads, n, d), k, v (batch, kv_heads, n, d) (RoPE applied)
        over the cache: the new k, v are written to `cache` (appended at `positions`, or in place at
        `slots`), then the layer's attention rule (causal, Gemma 3's sliding window, the cache policy's
        hook on global layers) -> (batch, heads, n, d) in q's dtype. `masks` is shared by the layers of
        one forward pass (masks and window plans are built once per pass). q_last: q holds only the last
        q_last of the n rows (batch, heads, q_last, d); `masks` must then be this call's own."""
        if slots is not None:  # recompute tokens already in the cache, in place
            k, v, k_pos = cache.write_at(self.layer, k, v, slots)
        elif cache is not None:
            k, v, k_pos = cache.write(self.layer, k, v, positions)
        else:
            k_pos = positions
        if q_last is not None:  # from here on, positions and slots are the queries'
            positions = positions[-q_last:]
            slots = None if slots is None else slots[-q_last:]
        kind = self.cfg.layer_types[self.layer]
        policy = getattr(cache, "policy", None)
        kernels = dispatch.backend_for(q) == "triton"  # the Triton kernels read a bf16 cache as it is
        if k.dtype != q.dtype and (policy is not None or not kernels) and not (kind == "sliding" and q.shape[2] <= 16):
            # a bf16 KV cache: attention is computed in the query's dtype (fp32); sliding decode below
            # casts only the window it reads
            k, v = k.to(q.dtype), v.to(q.dtype)
        if policy is not None and kind == "full":  # a per-sequence hook of the global layers
            # (RetrievalKV: retrieval attention; DebiasKV: position debiasing); None = normal attention
            out = policy.forward(self.layer, q, k, v, positions, k_pos, slots)  # (b, h, n, d) or None
            if out is not None:
                return out
        if kind == "sliding" and q.shape[2] <= 16 and "sliding_decode" not in masks:
            # decode: only the last `window` positions can be seen; read just those keys (exact).
            # Planned once per forward pass, shared by every sliding layer (None: positions not ascending)
            masks["sliding_decode"] = None
            if _ascending(k_pos):
                lo = int(torch.searchsorted(k_pos, positions.min() - self.cfg.sliding_window + 1))
                m = attention_mask(positions, k_pos[lo:], self.cfg.sliding_window)
                masks["sliding_decode"] = (lo, None if bool(m.all()) else m)
        if kernels:
            return self._attend_kernels(q, k, v, positions, k_pos, kind, slots, masks)
        if kind == "sliding" and q.shape[2] <= 16 and masks["sliding_decode"] is not None:
            lo, m = masks["sliding_decode"]
            k, v = k[:, :, lo:], v[:, :, lo:]
            if k.dtype != q.dtype:  # a bf16 cache: cast just the window
                k, v = k.to(q.dtype), v.to(q.dtype)
            return dispatch.attention(q, k, v, mask=m, scale=self.cfg.attn_scale)
        if kind == "sliding" and q.shape[2] > 16 and _ascending(positions) and _ascending(k_pos):
            # many queries: visit only the keys inside their windows
            if "window_plan" not in masks:  # shared by every sliding layer of this forward pass
                masks["window_plan"] = window_plan(positions, k_pos, self.cfg.sliding_window)
            return windowed_attention(q, k, v, positions, k_pos, self.cfg.sliding_window, self.cfg.attn_scale,
                                      plan=masks["window_plan"])
        if kind == "full" and slots is not None and q.shape[2] > CAUSAL_GROUP:
            # tokens recomputed in place, scattered through the cache: groups read the keys up to their last
            if "causal_plan" not in masks:  # shared by every global layer of this forward pass
                masks["causal_plan"] = causal_plan(positions, k_pos)
            if masks["causal_plan"] is not None:
                if k.dtype != q.dtype:
                    k, v = k.to(q.dtype), v.to(q.dtype)
                return windowed_attention(q, k, v, positions, k_pos, None, self.cfg.attn_scale,
                                          plan=masks["causal_plan"])
        if kind not in masks:
            window = self.cfg.sliding_window if kind == "sliding" else None
            if (window is None and q.shape[2] > 16 and q.shape[2] == k.shape[2] and torch.equal(positions, k_pos)
                    and _ascending(positions)):
                # queries are the keys, ascending: the mask is the lower triangle, which SDPA's causal form
                # computes without reading a mask and skipping the tiles above the diagonal (same result)
                masks[kind] = "causal"
            else:
                m = attention_mask(positions, k_pos, window)
                masks[kind] = None if bool(m.all()) else m
        if k.dtype != q.dtype:  # a bf16 cache that reached here uncast
            k, v = k.to(q.dtype), v.to(q.dtype)
        if isinstance(masks[kind], str):
            return dispatch.attention(q, k, v, scale=self.cfg.attn_scale, causal=True)  # (b, h, n, d)
        return dispatch.attention(q, k, v, mask=masks[kind], scale=self.cfg.attn_scale)  # (b, h, n, d)

    def _attend_kernels(self, q, k, v, positions, k_pos, kind: str, slots, masks: dict) -> torch.Tensor:
        """`attend` through the Triton kernels (CUDA tensors; on the CPU with LDQA_KERNELS=triton under
        TRITON_INTERPRET=1): the cache's dtype as it is (q rounded to it: a bf16 cache is read as bf16),
        the output in q's dtype. The rule is `attention_mask`'s (causal by position, the sliding window),
        given to the kernels as positions rather than a mask: one appended token (decode) reads the whole
        cache split-KV (Flash-Decoding; generation appends at the next position, after every cached key)
        or, on a sliding layer, the keys of its window (`masks["sliding_decode"]`); a prompt appended to an
        empty cache is the causal prefill; anything else (tokens recomputed in place, a prompt after
        reused blocks) runs the prefill kernel with explicit positions. Same shapes as `attend`."""
        dtype, scale = q.dtype, self.cfg.attn_scale
        if k.dtype != dtype:
            q = q.to(k.dtype)
        window = self.cfg.sliding_window if kind == "sliding" else None
        n, L = q.shape[2], k.shape[2]
        plan = masks.get("sliding_decode") if window is not None and n <= 16 else None
        if plan is not None:  # a sliding layer's decode: the keys of the window
            lo, m = plan
            k, v, k_pos = k[:, :, lo:], v[:, :, lo:], k_pos[lo:]
            if n == 1 and m is None and slots is None:
                return dispatch.decode_attention(q, k, v, scale=scale, causal=False)[0].to(dtype)
        if n == 1 and window is None and slots is None:
            out = dispatch.decode_attention(q, k, v, scale=scale, causal=False)[0]
        elif n == L and slots is None and _plain_prompt(positions, k_pos, masks):
            out = dispatch.prefill_attention(q, k, v, scale=scale, causal=True, window=window)[0]
        else:
            out = dispatch.prefill_attention(q, k, v, scale=scale, causal=True, window=window, q_pos=positions,
                                             k_pos=k_pos)[0]
        return out.to(dtype)


# Whether a pass that returns only the last token's logits runs its last layer's attention and MLP for
# that row alone (every row's K/V still written; `Transformer.forward`). The same cache, and logits that
# differ by the GEMM's summation order for one row against many
LAST_ROW_ONLY = True

# prefill rows per chunk of the MLP (`MLP.forward`): a chunk's (rows, intermediate) fp32 activations, 9 MB
# for Qwen2.5 1.5B's 8,960, fit a CPU's last-level cache
MLP_CHUNK_ROWS = 256


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
            self.act = lambda t: F.gelu(t, approximate="tanh")
        elif cfg.hidden_act == "silu":
            self.act = F.silu
        else:
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")

    def forward(self, x):
        """x (..., hidden) -> (..., hidden). A prefill whose projections dequantize their weights for a bf16
        GEMM (`QLinear.prefill_weight`) runs in chunks of MLP_CHUNK_ROWS rows over weights dequantized once:
        the (rows, intermediate) activations of a chunk stay in the CPU's caches between the GEMMs and the
        element-wise passes (act, product, dtype casts), which over a whole prompt stream from memory. Every
        row is computed by the same operations either way."""
        rows = x.numel() // x.shape[-1]
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        ws = ([p.prefill_weight(rows) for p in projections]
              if rows > MLP_CHUNK_ROWS and all(hasattr(p, "prefill_weight") for p in projections)
              and not int8_lead_active() else [None])  # (a pass split between two GEMMs: whole, `QLinear`)
        if any(w is None for w in ws):
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        x2 = x.reshape(rows, x.shape[-1])
        out = torch.empty(rows, self.down_proj.out_features, dtype=x.dtype, device=x.device)
        for a in range(0, rows, MLP_CHUNK_ROWS):
            xc = x2[a:a + MLP_CHUNK_ROWS]
            h = self.act(self.gate_proj.apply_prefill(xc, ws[0])) * self.up_proj.apply_prefill(xc, ws[1])
            out[a:a + MLP_CHUNK_ROWS] = self.down_proj.apply_prefill(h, ws[2])
        return out.view(*x.shape[:-1], self.down_proj.out_features)


class DecoderLayer(nn.Module):
    """One transformer block through its torch modules (its C decode, where the model's runner has one, is
    `decode_runner.FusedDecode`, which shares `Attention.attend`)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        gemma = cfg.family == "gemma3"
        self.sandwich = gemma  # Gemma: extra norms after attention and after the MLP
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)

    def forward(self, x, cos, sin, positions, cache, masks, slots=None, q_last: int | None = None):
        """x: (batch, n, hidden) -> (batch, n, hidden) (`Attention.forward`'s arguments; with q_last,
        (batch, q_last, hidden): the last rows' outputs, every row's K/V written)."""
        a = self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, masks, slots, q_last)
        if q_last is not None:
            x = x[:, -q_last:]
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family == "gemma3")


class Transformer(nn.Module):
    """Decoder-only LM. `forward(tokens, positions, cache)` -> logits.

    tokens: (batch, n) int64; positions: (n,) int64 absolute positions of these tokens (shared by the
    batch); cache: a KVCache to read the past from and append these tokens to (None: no past, nothing
    stored). logits: (batch, n, vocab) float32 when `all_logits`, else (batch, 1, vocab) for the last
    token only (prefill need not pay the vocabulary projection for every prompt token).
    decoder: the `decode_runner.DecodeRunner` that runs the passes' layers (torch modules unless the loader
    chose a C runner for q8_0/gguf weights).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._freqs = {}  # (theta, scaling, device) -> inv_freq float64; ("groups", device) -> rope_layer_groups
        self.kv_dtype = torch.float32  # dtype of new KV caches (the loader sets it: fp32 or bf16)
        self.weight_format = "fp32"  # set by the loader (quant.WEIGHT_FORMATS)
        self.decoder: DecodeRunner = TorchLayers()  # the loader sets it (decode_runner.choose_runner)

    @property
    def device(self) -> torch.device:
        """Where the weights are (the loader's `device`); new KV caches and the RoPE tables are made here."""
        return self.model.norm.weight.device

    def rope_layer_groups(self) -> list[tuple[torch.Tensor, list[int]]]:
        """The layers grouped by their RoPE inverse frequencies (`freqs_for` at the model's own base):
        [(inv_freq (head_dim/2,) float64, layer indices)], one group for Qwen2.5 and Llama, two for Gemma 3
        (local and global layers). Memoized per device."""
        device = self.device
        key = ("groups", device)
        if key not in self._freqs:
            groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
            for layer in range(self.cfg.num_layers):
                f = self.freqs_for(layer)
                groups.setdefault(id(f), (f, []))[1].append(layer)
            self._freqs[key] = list(groups.values())
        return self._freqs[key]

    def freqs_for(self, layer: int, theta_scale: float = 1.0) -> torch.Tensor:
        """RoPE inverse frequencies (head_dim/2,) float64 of `layer`, on the model's device; `theta_scale`
        multiplies the RoPE base of global-attention ("full") layers only (Attention Buckets; sliding layers
        keep theirs)."""
        theta, scaling = self.cfg.theta_for(layer), self.cfg.scaling_for(layer)
        if theta_scale != 1.0 and self.cfg.layer_types[layer] == "full":
            theta = theta * theta_scale
        device = self.device
        key = (theta, repr(scaling), device)
        if key not in self._freqs:
            self._freqs[key] = inv_freq(self.cfg.head_dim, theta, scaling).to(device)
        return self._freqs[key]

    def rope_tables(self, positions: torch.Tensor, theta_scale: float, dtype: torch.dtype, layers: range) -> list:
        """RoPE cos, sin (n, head_dim) in `dtype` at `positions` (n,) for each layer of `layers`, in order:
        one pair of tensors per distinct RoPE base, shared by the layers that have it."""
        tables, out = {}, []
        for i in layers:
            f = self.freqs_for(i, theta_scale)
            if id(f) not in tables:
                tables[id(f)] = rope_cos_sin(positions, f, dtype)
            out.append(tables[id(f)])
        return out

    @torch.inference_mode()
    def layer_keys(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys layer `layer` computes from `hidden` (1, n, hidden_size), the hidden states entering
        it, at absolute `positions` (n,): (1, kv_heads, n, head_dim), RoPE applied with the layer's own
        base (CacheBlend compares them with cached keys, `block_attention.BlockRuntime._select`)."""
        block = self.model.layers[layer]
        cos, sin = rope_cos_sin(positions.to(hidden.device), self.freqs_for(layer), hidden.dtype)
        return block.self_attn.project_kv(block.input_layernorm(hidden), cos, sin)[0]

    @torch.inference_mode()
    def write_layer_kv(self, layer: int, hidden: torch.Tensor, cache: KVCache, slots: torch.Tensor) -> None:
        """Overwrite layer `layer`'s K/V at cache `slots` (n,) with the ones it computes from `hidden`
        (1, n, hidden_size), the hidden states entering it, at the slots' positions (RoPE with the layer's
        base and the cache's `theta_scale`). A token stopped at that layer this way has the K/V a full
        pass would give it there (`block_attention.BlockRuntime._recompute`'s gradual filtering)."""
        if len(slots) == 0:
            return
        block = self.model.layers[layer]
        positions = cache.positions[slots.to(cache.positions.device)]
        f = self.freqs_for(layer, getattr(cache, "theta_scale", 1.0))
        cos, sin = rope_cos_sin(positions.to(hidden.device), f, hidden.dtype)
        k, v = block.self_attn.project_kv(block.input_layernorm(hidden), cos, sin)
        cache.write_at(layer, k, v, slots.to(hidden.device))

    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        """An empty KV cache for `batch` sequences in `kv_dtype`, on the model's device."""
        return KVCache(self.cfg.num_layers, batch, self.cfg.num_kv_heads, self.cfg.head_dim,
                       dtype=self.kv_dtype, device=self.device, capacity=capacity)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        if self.cfg.family == "gemma3":  # Gemma scales embeddings by sqrt(hidden), rounded to the dtype
            x = x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)
        return x

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                all_logits: bool = False, slots: torch.Tensor | None = None,
                n_layers: int | None = None, start: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """slots: (n,) cache slots that already hold these tokens (their positions set): their K/V are
        recomputed and overwritten layer by layer, each layer attending over the whole cache (causal by
        position); the cache does not grow. n_layers: stop after that many layers and return the hidden
        states (b, n, hidden) instead of logits (the cache holds those layers' K/V for these tokens, not
        yet counted in its length). start: (layer j, hidden states (b, n, hidden) entering layer j) resumes
        such a pass at layer j: layers below j are skipped and must already hold these tokens' K/V (and
        positions) in `cache`'s next slots, as `n_layers=j` leaves them. A pass split this way is the same
        computation, bit for bit, as one pass. Raises ValueError for a `start` layer out of range.
        tokens, positions and slots may be on the CPU: they are moved to the model's device."""
        device = self.device
        if device.type != "cpu":  # the callers build ids, positions and slots on the CPU
            tokens, positions = tokens.to(device), positions.to(device)
            slots = slots.to(device) if slots is not None else None
        if slots is None and n_layers is None and start is None:  # a whole pass appending `tokens`
            logits = self.decoder.step(self, tokens, positions, cache)  # one C call where the runner can
            if logits is not None:
                return logits
        if start is None:
            first, x = 0, self.embed(tokens)  # (b, n, hidden)
        else:
            first, x = start
            if not 0 <= first <= len(self.model.layers):
                raise ValueError(f"start layer {first} is outside 0..{len(self.model.layers)}")
        masks: dict = {}
        theta_scale = cache.theta_scale if cache is not None else 1.0
        run = self.decoder.layers(self.model.layers, x, slots)  # per layer: its modules or its C decode
        todo = range(len(self.model.layers))[first:n_layers]
        # Only the last token's logits are asked for: the last layer computes every row's K/V but
        # attention, o_proj and the MLP for the last row only (llama.cpp skips the same rows), through the
        # whole pass's arithmetic (`quant.pass_rows`); not under a cache policy, whose hooks may read every
        # query (DebiasKV records the question's), nor where a linear layer's rounding depends on its row
        # count (`QLinear.row_independent`: a few rows through the C kernels)
        last = len(self.model.layers) - 1
        n = x.shape[1]
        last_only = (LAST_ROW_ONLY and not all_logits and n_layers is None and n > 1
                     and getattr(cache, "policy", None) is None and isinstance(run[last], DecoderLayer)
                     and all(m.row_independent(n) for m in run[last].modules() if hasattr(m, "row_independent")))
        for i, (cos, sin) in zip(todo, self.rope_tables(positions, theta_scale, x.dtype, todo)):
            if i == last and last_only:
                with pass_rows(n):
                    x = run[i](x, cos, sin, positions, cache, {}, slots, q_last=1)
            else:
                x = run[i](x, cos, sin, positions, cache, masks, slots)
        if n_layers is not None:
            return x
        if cache is not None and slots is None:
            cache.advance(tokens.shape[1])
        if not all_logits:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()
