"""The decode backend: how a forward pass's layers run, chosen once at load and held by the model.

`choose_runner(model)` builds one runner (`Transformer.decoder`); `Transformer.forward` asks it two things
and tests nothing else: `step` (run this whole pass, or None) and `layers` (what runs each layer).

- `TorchLayers` ("torch"): every pass through the layers' torch modules.
- `CLayers` ("c-layers"): a pass of one fp32 token of one sequence, not recomputed in place, runs each
  layer whose matrices are all q8_0 or gguf in two C calls around its `Attention.attend` (`FusedDecode`);
  every other pass (prefill, batches, bf16 activations, `slots`) runs the modules.
- `CStep` ("c-step"): a plain decode step (`CStep.step` says which) in one C call for all layers
  (`cpu_linear.DecodeStack`); every other pass as `CLayers`.

The loader takes the most a model allows: `CStep` when every layer's matrices are q8_0 or gguf and the C
kernel is built, `CLayers` when only some are, `TorchLayers` for the other weight formats or without the
kernel (`LDQA_CPU_KERNELS=torch`). The three compute the same formulas; `CStep` gives `CLayers`'s numbers
bit for bit, `CLayers` the modules' up to fp32 summation order (tests/test_fused_decode.py).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.nn as nn

from ldqa.attention.kv_cache import KVCache
from ldqa.attention.quant import QLinear
from ldqa.kernels import cpu_linear, dispatch


class DecodeRunner(Protocol):
    """The contract of `Transformer.decoder`.

    kind: "torch", "c-layers" or "c-step".
    step(model, tokens, positions, cache): a whole forward pass that appends tokens (b, n) int64 at
        positions (n,) to `cache` and runs every layer (no slots, n_layers, start) -> logits (1, 1, vocab)
        float32 with the cache advanced, or None where this runner leaves the pass to the layers.
    layers(modules, x, slots): what runs each layer of a pass whose hidden states entering the layers are
        x (b, n, hidden), given the model's `modules` (its DecoderLayers) and the pass's `slots` (or None):
        per layer a callable f(x, cos, sin, positions, cache, masks, slots) -> x (b, n, hidden), the
        module itself or its C decode.
    """

    kind: str

    def step(self, model, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor | None: ...

    def layers(self, modules: Sequence[nn.Module], x: torch.Tensor, slots) -> Sequence[Callable]: ...


class TorchLayers:
    """Every pass through the layers' torch modules (fp32, bf16, int8, int4 weights; no C kernel)."""

    kind = "torch"

    def step(self, model, tokens, positions, cache) -> None:
        """Never runs a pass whole: None."""
        return None

    def layers(self, modules, x, slots):
        """The modules, for every pass."""
        return modules


class CLayers:
    """One fp32 token of one sequence, appended (no `slots`): each layer with a `FusedDecode` runs it (two
    C calls around `Attention.attend`, so every attention mode and cache policy runs unchanged), the other
    layers their modules; any other pass (prefill, a batch, bf16 activations, recompute in place) runs the
    modules. modules: the model's DecoderLayers; fused: per layer its FusedDecode or None."""

    kind = "c-layers"

    def __init__(self, modules: Sequence[nn.Module], fused: list[FusedDecode | None]):
        self.fused = fused
        self._decode = [m if f is None else f for m, f in zip(modules, fused)]

    def step(self, model, tokens, positions, cache) -> None:
        """Never runs a pass whole: None."""
        return None

    def layers(self, modules, x, slots):
        """The C decode of the fused layers where x is (1, 1, hidden) float32 and slots None, else `modules`."""
        if slots is None and x.shape[0] == 1 and x.shape[1] == 1 and x.dtype == torch.float32:
            return self._decode
        return modules


class CStep(CLayers):
    """`CLayers`, and a plain decode step's layers in one C call (`cpu_linear.DecodeStack`, the same C
    functions in the same order as the per-layer path: the same logits bit for bit, without the ~0.1 ms of
    Python a layer costs between them). Every layer must have a FusedDecode; cfg is the model's ModelConfig."""

    kind = "c-step"

    def __init__(self, modules: Sequence[nn.Module], fused: list[FusedDecode], cfg):
        super().__init__(modules, fused)
        self.cfg = cfg
        self.stack = cpu_linear.DecodeStack([f.kernel for f in fused], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                            cfg.rms_norm_eps, cfg.attn_scale)

    def step(self, model, tokens, positions, cache):
        """One decode token through every layer in one C call -> logits (1, 1, vocab), or None when this step
        needs the per-layer path: more than one token, no cache or a cache that is not a plain fp32 KVCache
        of one sequence on the CPU, a policy on it whose decode attention is not the layers' own plus a
        per-slot bias (retrieval attention; a policy with `decode_bias(length) -> (length,) float32` on its
        global layers, such as debiasing's `DebiasKV`, runs here), LDQA_KERNELS=torch, or cached positions
        that are not ascending with the new one after them (then a mask is needed, which the stack does not
        take). Where it runs, every layer attends to all cached keys (global layers) or the last
        `sliding_window` positions (sliding layers), as the per-layer path does."""
        decode_bias = getattr(getattr(cache, "policy", None), "decode_bias", None)
        if (tokens.shape != (1, 1) or type(cache) is not KVCache
                or (cache.policy is not None and decode_bias is None)
                or positions.numel() != 1 or cache._k[0].dtype != torch.float32 or cache._k[0].shape[0] != 1
                or cache._k[0].device.type != "cpu" or not cache._k[0].is_contiguous()
                or dispatch._forced() == "torch"):
            return None
        p, n0 = int(positions[0]), cache.length
        k_pos = cache._pos[:n0]  # (n0,)
        if n0 and (int(k_pos[-1]) >= p or not bool((k_pos[1:] > k_pos[:-1]).all())):
            return None
        lo_sliding = 0
        if self.cfg.sliding_window and "sliding" in self.cfg.layer_types:
            lo_sliding = int(torch.searchsorted(k_pos, p - self.cfg.sliding_window + 1))
        x = model.embed(tokens).float().contiguous()  # (1, 1, hidden)
        cache._grow(n0 + 1)
        cache._pos[n0] = p
        rope = model.rope_tables(positions, cache.theta_scale, torch.float32, range(len(self.fused)))
        per_layer = [(cos.contiguous(), sin.contiguous()) for cos, sin in rope]  # (1, head_dim) each
        lo = [lo_sliding if kind == "sliding" else 0 for kind in self.cfg.layer_types]
        bias = None
        if decode_bias is not None:  # the policy's hook runs on the global layers only (`Attention.attend`)
            b = decode_bias(n0 + 1).float().contiguous()
            bias = [b if kind == "full" else None for kind in self.cfg.layer_types]
        self.stack.run(x, cache._k, cache._v, per_layer, lo, n0, bias)
        cache.advance(1)
        return model.lm_head(model.model.norm(x)).float()  # (1, 1, vocab)


def choose_runner(model: nn.Module) -> DecodeRunner:
    """The runner for a Transformer's weights as loaded: `CStep` when every layer is `fusable` and the C
    kernel is available, `CLayers` when some are, else `TorchLayers`. The C runners read the modules'
    weights and norm multipliers as they are now: choose again after changing them."""
    modules, cfg = model.model.layers, model.cfg
    if not any(fusable(layer, cfg) for layer in modules) or not cpu_linear.available():
        return TorchLayers()
    fused = [FusedDecode(layer, cfg) if fusable(layer, cfg) else None for layer in modules]
    if all(f is not None for f in fused):
        return CStep(modules, fused, cfg)
    return CLayers(modules, fused)


def fusable(layer: nn.Module, cfg) -> bool:
    """Whether a DecoderLayer's decode can run in C: its seven matrices q8_0 or gguf QLinears on the CPU
    with at most `cpu_linear.MAX_K` inputs, an activation the kernel has, no o_proj bias."""
    a, m = layer.self_attn, layer.mlp
    mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
    return (all(isinstance(p, QLinear) and p.fmt in ("q8_0", "gguf") and p.in_features <= cpu_linear.MAX_K
                and next(p.buffers()).device.type == "cpu" for p in mods)
            and cfg.hidden_act in ("silu", "gelu_pytorch_tanh", "gelu_tanh")
            and a.o_proj.bias is None)


class FusedDecode:
    """One decoder layer's decode (one token of one sequence) in two calls of ldqa's C kernel (q8_0 and
    gguf weights, each matrix its own type): `attn_in` (input RMSNorm, the q, k, v projections in one
    parallel loop, q/k norms, RoPE) and `attn_out` (o_proj, the norms and residual adds, gate and up in one
    parallel loop, the activation, down_proj). Attention itself stays `Attention.attend` (KV cache, masks,
    the global layers' hooks), so every attention mode runs unchanged. Called as the layer:
    `fused(x, cos, sin, positions, cache, masks)`.

    Why: a decode step of Gemma 3 270M through the modules runs ~1,900 small torch ops (~100 per layer, a
    few µs each) around its matmuls, and 7 kernel calls per layer; this makes it 2 calls + attention's ops
    (docs/kernels.md). The arithmetic is the modules' (same formulas, fp32), not bit-identical: sums run in
    another order (tests/test_cpu_linear.py bounds the difference).

    It reads the modules' own weight buffers (held once; prefill uses the modules) and the norms'
    multipliers as they are when built.
    """

    def __init__(self, layer: nn.Module, cfg):
        a, m = layer.self_attn, layer.mlp
        self.attn = a
        biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        self.bias = None if biases[0] is None else torch.cat(biases).float().contiguous()
        if layer.sandwich:  # Gemma 3: x + n(o) -> h; h + n(mlp(n(h)))
            attn_norm, ff_norm = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            ff_out_norm = layer.post_feedforward_layernorm
        else:  # x + o -> h; h + mlp(n(h))
            attn_norm, ff_norm, ff_out_norm = None, layer.post_attention_layernorm, None

        def mult(norm):  # the norm's multiplier as it is now (norm weights do not change after loading)
            return None if norm is None else norm.multiplier().contiguous()

        self.n_heads, self.n_kv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.kernel = cpu_linear.DecodeLayer(
            q=kernel_weight(a.q_proj), k=kernel_weight(a.k_proj), v=kernel_weight(a.v_proj), bias=self.bias,
            n_heads=self.n_heads, n_kv=self.n_kv, head_dim=self.d, in_norm=mult(layer.input_layernorm),
            q_norm=mult(a.q_norm) if cfg.qk_norm else None, k_norm=mult(a.k_norm) if cfg.qk_norm else None,
            o=kernel_weight(a.o_proj), attn_norm=mult(attn_norm), ff_norm=mult(ff_norm),
            ff_out_norm=mult(ff_out_norm), gate=kernel_weight(m.gate_proj), up=kernel_weight(m.up_proj),
            down=kernel_weight(m.down_proj), act="silu" if cfg.hidden_act == "silu" else "gelu_tanh",
            eps=cfg.rms_norm_eps)

    def __call__(self, x, cos, sin, positions, cache, masks, slots=None) -> torch.Tensor:
        """The layer on x (1, 1, hidden) float32 at positions (1,), cos, sin (1, head_dim): attn_in, the
        layer's `Attention.attend` (writing the cache), attn_out -> (1, 1, hidden). slots must be None."""
        q, k, v = self.attn_in(x, cos, sin)
        return self.attn_out(x, self.attn.attend(q, k, v, positions, cache, masks))

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: (1, 1, hidden) float32; cos, sin: (1, head_dim) -> q (1, heads, 1, d), k, v (1, kv_heads, 1, d)."""
        h, kv, d = self.n_heads, self.n_kv, self.d
        out = self.kernel.attn_in(_dense(x), _dense(cos), _dense(sin))
        return out.view(1, h + 2 * kv, 1, d).split((h, kv, kv), dim=1)

    def attn_out(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x: (1, 1, hidden) the layer's input; attn: (1, heads, 1, d) attention output -> (1, 1, hidden)."""
        return self.kernel.attn_out(_dense(x), _dense(attn))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous float32 (itself when it already is: the kernels read its memory in order)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def kernel_weight(mod: QLinear) -> tuple:
    """A q8_0 or gguf QLinear's weight as the C kernel takes it (`cpu_linear.mat`): (ggml type, w, d)."""
    if mod.fmt == "q8_0":
        return cpu_linear.Q8_0_TYPE, mod.qweight, mod.bscales
    return mod.ggml_type, mod.blocks, None
