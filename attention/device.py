"""Where the LLM runs: the `device` option's names, their checks and each device's defaults.

`check_device` and the defaults are torch-free (the CLI's `--help` imports them); `resolve_device` asks
torch whether it sees a CUDA device. On CUDA the weights are bf16 (a GGUF's blocks dequantized once, as
for `weights="bf16"` on the CPU: ldqa's quantized matmuls are C kernels for the CPU) and the KV cache is
bf16; attention goes to the Triton kernels through `kernels/dispatch.py`. On the CPU nothing changes.
"""

from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")  # "cuda:N" names one GPU of several
DEVICE_HELP = "auto (default: CUDA when torch sees a GPU, else the CPU), cpu or cuda (cuda:N for one GPU of several)"
# the weight formats and KV dtypes a device runs, its default first
DEVICE_WEIGHTS = {"cuda": ("bf16", "fp32")}
DEVICE_KV_DTYPE = {"cpu": "fp32", "cuda": "bf16"}


def check_device(device: str) -> str:
    """Validate a device name ("auto", "cpu", "cuda" or "cuda:N"); returns it. Raises ValueError naming it
    and the allowed names. Torch-free: says nothing about whether a GPU is there (`resolve_device` does)."""
    if isinstance(device, str) and (device in DEVICES or (device.startswith("cuda:") and device[5:].isdigit())):
        return device
    raise ValueError(f"device {device!r}: use {DEVICE_HELP}")


def device_arg(value: str) -> str:
    """The argparse type of `--device`: `check_device`, its error as argparse's (exit 2 with the message)."""
    import argparse

    try:
        return check_device(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_device(device: str = "auto") -> str:
    """The device a model is put on: "auto" -> "cuda" when torch sees a CUDA device, else "cpu"; "cpu",
    "cuda" and "cuda:N" as given once checked. Raises ValueError for an unknown name, and for a CUDA device
    torch does not see (no GPU, a CPU-only torch build, N out of range), saying to use "cpu" or "auto"."""
    import torch

    check_device(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device[5:]) if ":" in device else 0
        if index >= n:
            why = (f"this torch build ({torch.__version__}) has no CUDA support" if torch.version.cuda is None
                   else "torch sees no CUDA device" if n == 0 else f"torch sees {n} CUDA device{'s' * (n > 1)}")
            raise ValueError(f"device {device!r}: {why}; use device 'cpu' or 'auto' (--device cpu)")
    return device


def device_kind(device: str) -> str:
    """"cpu" or "cuda" for a resolved device name ("cuda:1" -> "cuda")."""
    return device.split(":")[0]


def default_kv_dtype(device: str) -> str:
    """The KV cache dtype a model on `device` (resolved) gets when none is asked for: fp32 on the CPU (exact
    against the reference), bf16 on CUDA (half the memory and bandwidth; the Triton kernels read it)."""
    return DEVICE_KV_DTYPE[device_kind(device)]


def check_weights_on(weights: str, device: str) -> str:
    """`weights` if the device runs that format, else ValueError naming both and the formats it runs:
    q8_0, gguf, int8 and int4 compute through CPU kernels (ldqa's C code, aten's CPU packed ops)."""
    import os

    allowed = DEVICE_WEIGHTS.get(device_kind(device))
    if allowed is not None and weights not in allowed:
        source = " (from $LDQA_WEIGHTS)" if os.environ.get("LDQA_WEIGHTS") == weights else ""
        raise ValueError(f"weights {weights!r}{source} run on the CPU's kernels, not on device {device!r}: use "
                         f"weights {' or '.join(repr(w) for w in allowed)} there (default {allowed[0]!r}), or "
                         "--device cpu")
    return weights
