"""How many threads a decode step runs on, chosen by measurement while decoding.

Why: a decode step of a small model is ~80 short parallel regions (the C kernel's matmuls, attention),
each ending in a barrier. On an idle machine two threads decode ~25% faster than one (docs/results.md).
When another process occupies one of the cores, every barrier waits for the thread the OS has
descheduled: a fresh-clone check measured 0.8-1.4 tokens/s with torch's default two threads against 30-44
with one. No setting is right for both machines, and the load changes while ldqa runs.

`DecodeThreads` measures it: it starts on one thread, probes the other count (the most, or 1) for a few
steps after `first_probe` steps and then every `probe_every` steps, and keeps the count whose recent steps
had the lower median time; a count that keeps losing is probed less and less often (see the class).
Idle machine: after the first probe, decode runs on all cores; the probes then cost ~1% of decode time.
Busy machine: it stays on one thread, and a probe of two threads ends after one slow step.
One instance per process (`decode_threads()`): what it learned carries over to the next answer, and
the next answer's prefill runs on the count it last chose (`prefill_on`; a first answer's prefill
probes a few of its own layers on each count).

Off (the thread count is left alone) when the user chose one: $OMP_NUM_THREADS or $LDQA_DECODE_THREADS
set (a number: that many threads for decode; `auto`: this governor even so), or `torch.set_num_threads`
called with anything else than the process's starting count (Ray workers, benchmarks pinning threads).
With q8_0 and gguf weights the answers do not depend on it (the C kernels compute each output the same
way on any number of threads: tests/test_threads.py); torch's own matmuls (fp32, bf16, int8, int4) may
round differently on another thread count.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque

import torch

FIRST_PROBE = 4  # decode steps before the first probe
PROBE_EVERY = 32  # steps between probes (doubled after each probe the other count loses, up to MAX_BACKOFF x)
PROBE_STEPS = 2  # steps per probe on the other thread count
WINDOW = 6  # recent step times kept per thread count
MAX_BACKOFF = 16
GIVE_UP = 2.0  # a probe step this many times slower than the best's median ends the probe at once


class DecodeThreads:
    """Picks the decode thread count between `most` and 1 by measured step time (see the module).

    Use per decode step: `n = threads()` (the count for this step; the caller sets it), time the step,
    `record(n, seconds)`. One generation at a time per process (the runtime's lock).
    `most`: the largest count (torch's starting thread count); 1: nothing to choose.
    Starts on one thread: a probe of the slower count costs little when one thread is slower (a few ms a
    step on an idle machine) and a lot when it is the faster (a barrier per parallel region waits for a
    descheduled thread: ~10x a step), so the costly case is probed less and less often while it keeps
    losing (the interval doubles up to MAX_BACKOFF x `probe_every`) and a probe step that is GIVE_UP x
    slower than the current choice ends its probe at once.
    """

    def __init__(self, most: int, first_probe: int = FIRST_PROBE, probe_every: int = PROBE_EVERY,
                 probe_steps: int = PROBE_STEPS, window: int = WINDOW):
        if most < 1 or probe_steps < 1 or probe_every <= probe_steps or first_probe < 0:
            raise ValueError(f"DecodeThreads: most={most}, first_probe={first_probe}, probe_every={probe_every}, "
                             f"probe_steps={probe_steps} (need most >= 1, probe_every > probe_steps >= 1)")
        self.most, self.best = most, 1
        self.probe_every, self.probe_steps = probe_every, probe_steps
        self.times = {most: deque(maxlen=window), 1: deque(maxlen=window)}
        self.steps = 0
        self.next_probe, self.interval, self.probe_left, self.probe = first_probe, probe_every, 0, []
        self.switches = 0  # times `best` changed (reported by benchmarks)

    @property
    def other(self) -> int:
        return 1 if self.best != 1 else self.most

    def prefill_count(self) -> int | None:
        """The thread count for the next prefill (`prefill_on`): `best` once both counts have been timed
        (after the first probe), else None (nothing measured yet: leave torch's count as it is)."""
        if self.most == 1 or not (self.times[1] and self.times[self.most]):
            return None
        return self.best

    def threads(self) -> int:
        """The thread count for the next decode step."""
        if self.most == 1:
            return 1
        if self.probe_left == 0 and self.steps >= self.next_probe:
            self.probe_left = self.probe_steps
        return self.other if self.probe_left else self.best

    def record(self, threads: int, seconds: float) -> None:
        """One decode step's wall time (s) on `threads` threads; after a probe, re-choose."""
        self.steps += 1
        if threads not in self.times or self.most == 1:
            return
        best_times = self.times[self.best]
        if self.probe_left and threads == self.other:
            self.times[threads].append(seconds)
            self.probe.append(seconds)
            self.probe_left -= 1
            if best_times and seconds > GIVE_UP * statistics.median(best_times):
                self.probe_left = 0  # clearly slower: do not spend the probe's other steps on it
            if self.probe_left == 0:
                self._choose()
        else:
            best_times.append(seconds)

    def _choose(self) -> None:
        # the probe's fastest step against the current count's recent median: a probe's first step may pay
        # for waking the other threads, and a wrong switch is undone by the next probe
        a, probe, self.probe = self.times[self.best], self.probe, []
        if a and probe and min(probe) < statistics.median(a):
            self.best, self.interval = self.other, self.probe_every
            self.switches += 1
        else:
            self.interval = min(self.interval * 2, MAX_BACKOFF * self.probe_every)
        self.next_probe = self.steps + self.interval


_lock = threading.Lock()
_state: dict = {}


def decode_threads() -> DecodeThreads | int | None:
    """What decode steps run on (`Generation.threads`): the process's governor; an int, $LDQA_DECODE_THREADS
    when it holds a number; None (torch's thread count as it is) when the count is the user's otherwise:
    $OMP_NUM_THREADS set, or torch's thread count changed since this function was first called.
    Raises ValueError for an $LDQA_DECODE_THREADS that is neither a number >= 1 nor `auto`."""
    env = os.environ.get("LDQA_DECODE_THREADS", "").strip().lower()
    if env and env != "auto":
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"$LDQA_DECODE_THREADS={env!r}: set a thread count (1, 2, ...) or 'auto', or unset it")
        return int(env)
    with _lock:
        if "start" not in _state:
            _state["start"] = torch.get_num_threads()
        if env != "auto" and (os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() != _state["start"]):
            return None
        if "gov" not in _state:
            _state["gov"] = DecodeThreads(_state["start"])
        return _state["gov"]


def reset() -> None:
    """Forget the governor and the starting thread count (tests)."""
    with _lock:
        _state.clear()


# A layer call of fewer multiply-accumulates (its rows times its weights) is too short to time reliably and
# is not probed: 64 rows of Gemma 3 270M (5.6M weights per layer), 8 of Qwen2.5-Coder-1.5B (47M), so a block
# mode's question pass (~25 rows) is probed on a large model
PROBE_MIN_MACS = 3.5e8
PROBE_PAIRS = 2  # layer pairs (one on all cores, the next on one thread) a first prefill probes


def layer_weights(layer) -> int:
    """The weights a call of decoder `layer` multiplies each row by: the sum of in_features x out_features over
    its linear modules (nn.Linear and the quantized layers alike; 0 when it has none)."""
    return sum(m.in_features * m.out_features for m in layer.modules()
               if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int))


class prefill_on:
    """Context manager around an answer's prefill (the prompt, or Block-Attention's passage blocks and
    question): on the count the decode governor `threads` last chose (`DecodeThreads.prefill_count`) once
    it has measured both counts; before that (a process's first answer), when `model` is given, the
    prefill probes for itself: its first `PROBE_PAIRS` pairs of same-kind layer calls of at least
    `PROBE_MIN_MACS` multiply-accumulates (rows x `layer_weights`) run one on all cores and the next on one
    thread, timed, and the rest of the prefill runs on the count whose fastest layer was faster
    (`self.chosen`). Block modes' passes of the question alone are probed where the model is large enough:
    a fresh `ldqa ask --attention block` on the default model beside a two-thread job had its first token
    after 23-25 s against 30-39 s with those passes left on two threads (full attention: 42-48 s), the same
    9 s on an idle machine (docs/results.md). A fixed decode count or None (the user's count): torch's count
    as it is. torch's count is restored after.

    Why: a prefill's few long GEMMs suffer from a descheduled thread as decode's short regions do, if less:
    Gemma 3 270M gguf, 1,416 tokens, 2.1 s on two threads against 3.4 s on one on an idle machine, 6.0 s
    against 3.6 s next to a busy core (docs/results.md). The prefill's results do not
    depend on the count there (the same logits and KV cache bit for bit at 1 and 2 threads, gguf and fp32),
    so switching between layers changes nothing but time.
    """

    def __init__(self, threads: DecodeThreads | int | None, model=None):
        gov = threads if isinstance(threads, DecodeThreads) else None
        self.n = gov.prefill_count() if gov else None
        self.most = gov.most if gov else 1
        self.model = model if gov is not None and self.n is None and self.most > 1 else None
        self.chosen: int | None = None  # the probe's choice (None: no probe, or not finished)
        self.layer_ms: dict = {}  # (layer kind, threads) -> [ms of each probed layer call]

    def __enter__(self):
        self.prev = torch.get_num_threads()
        if self.n and self.n != self.prev:
            torch.set_num_threads(self.n)
        self._hooks = []
        if self.model is not None:
            kinds = self.model.cfg.layer_types or ["full"] * len(self.model.model.layers)
            for i, layer in enumerate(self.model.model.layers):
                self._hooks.append(layer.register_forward_pre_hook(self._pre(kinds[i], layer_weights(layer))))
                self._hooks.append(layer.register_forward_hook(self._post))
        return self

    def _pre(self, kind: str, weights: int):
        def hook(module, args):
            self._timing = None
            rows = args[0].shape[0] * args[0].shape[1]  # (batch, tokens, hidden): a batch of orders counts whole
            if self.chosen is not None or rows * weights < PROBE_MIN_MACS:
                return
            done = sum(len(v) for (k, _), v in self.layer_ms.items() if k == kind)
            n = self.most if done % 2 == 0 else 1  # a pair: all cores, then one thread
            torch.set_num_threads(n)
            self._timing = (kind, n, time.perf_counter())
        return hook

    def _post(self, module, args, output):
        if self._timing is None:
            return
        kind, n, t0 = self._timing
        self.layer_ms.setdefault((kind, n), []).append((time.perf_counter() - t0) * 1e3)
        many, one = self.layer_ms.get((kind, self.most), []), self.layer_ms.get((kind, 1), [])
        if len(one) >= PROBE_PAIRS and len(many) >= PROBE_PAIRS:
            self.chosen = 1 if min(one) < min(many) else self.most
            torch.set_num_threads(self.chosen)
            self._remove_hooks()
        else:
            torch.set_num_threads(self.prev)  # unprobed calls between probed ones run as they would have

    def _remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __exit__(self, *exc):
        self._remove_hooks()
        if torch.get_num_threads() != self.prev:
            torch.set_num_threads(self.prev)
        return False


class timed_step:
    """Context manager around one decode step on `threads` (see `decode_threads`): a governor's count for
    this step (its time recorded), a fixed count, or None (as it is); torch's count is restored after."""

    def __init__(self, threads: DecodeThreads | int | None):
        self.gov = threads if isinstance(threads, DecodeThreads) else None
        self.fixed = threads if isinstance(threads, int) else None

    def __enter__(self):
        self.prev = torch.get_num_threads()
        self.n = self.fixed or (self.gov.threads() if self.gov else self.prev)
        if self.n != self.prev:
            torch.set_num_threads(self.n)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.gov is not None and exc[0] is None:
            self.gov.record(self.n, time.perf_counter() - self.t0)
        if self.n != self.prev:
            torch.set_num_threads(self.prev)
        return False
