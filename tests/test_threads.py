"""The decode thread governor (attention/threads.py): its choice under simulated step times (no clock is
read), the settings that turn it off, and answers that do not depend on the thread count."""

import pytest
import torch

from ldqa.attention import threads as T


def _run(gov, cost, steps):
    """Drive `gov` for `steps` decode steps whose time on n threads is cost(n); returns the counts used."""
    used = []
    for _ in range(steps):
        n = gov.threads()
        used.append(n)
        gov.record(n, cost(n))
    return used


def test_busy_core_keeps_decode_on_one_thread_and_probes_ever_less():
    gov = T.DecodeThreads(2, first_probe=4, probe_every=32, probe_steps=2)
    used = _run(gov, lambda n: 0.250 if n == 2 else 0.025, 400)  # two threads 10x slower (a descheduled one)
    assert used[:4] == [1] * 4 and used[4:6] == [2, 1]  # the first probe: one slow step ends it
    probes = [i for i, n in enumerate(used) if n == 2]
    assert len(probes) <= 5 and all(b - a > 32 for a, b in zip(probes, probes[1:]))  # 32, 64, 128, 256 apart
    assert gov.best == 1 and gov.switches == 0


def test_idle_machine_moves_to_all_cores_after_the_first_probe():
    gov = T.DecodeThreads(2, first_probe=4, probe_every=32, probe_steps=2)
    used = _run(gov, lambda n: 0.021 if n == 2 else 0.026, 400)
    assert used[:4] == [1] * 4 and used[4:6] == [2, 2] and set(used[6:36]) == {2}
    assert gov.best == 2 and gov.switches == 1
    assert used.count(1) <= 4 + 2 * (1 + 400 // 32)  # the start, then only probes


def test_a_slow_first_probe_step_does_not_hide_the_faster_count():
    # the first step on two threads pays for waking them: the probe's fastest step counts
    gov = T.DecodeThreads(2, first_probe=2, probe_every=32, probe_steps=2)
    times = iter([0.026, 0.026, 0.040, 0.021] + [0.021] * 50)
    _run(gov, lambda n: next(times), 20)
    assert gov.best == 2


def test_it_follows_the_load_when_it_changes():
    gov = T.DecodeThreads(2, first_probe=0, probe_every=8, probe_steps=2, window=4)
    _run(gov, lambda n: 0.02 if n == 2 else 0.03, 24)  # idle: two threads
    assert gov.best == 2
    _run(gov, lambda n: 0.25 if n == 2 else 0.03, 24)  # another job starts: one thread
    assert gov.best == 1
    _run(gov, lambda n: 0.02 if n == 2 else 0.03, 8 * 16 * 2)  # it ended: back to two, within the backoff
    assert gov.best == 2


def test_one_thread_machines_and_bad_settings():
    assert _run(T.DecodeThreads(1), lambda n: 1.0, 50) == [1] * 50
    with pytest.raises(ValueError, match="probe_every > probe_steps"):
        T.DecodeThreads(2, probe_every=2, probe_steps=2)


def test_the_user_s_thread_count_turns_it_off(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LDQA_DECODE_THREADS", raising=False)
    before = torch.get_num_threads()
    T.reset()
    try:
        assert isinstance(T.decode_threads(), T.DecodeThreads)
        monkeypatch.setenv("LDQA_DECODE_THREADS", "1")
        assert T.decode_threads() == 1  # a fixed count for decode
        monkeypatch.setenv("LDQA_DECODE_THREADS", "two")
        with pytest.raises(ValueError, match="LDQA_DECODE_THREADS='two'"):
            T.decode_threads()
        monkeypatch.setenv("LDQA_DECODE_THREADS", "auto")
        assert isinstance(T.decode_threads(), T.DecodeThreads)
        monkeypatch.delenv("LDQA_DECODE_THREADS")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert T.decode_threads() is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        torch.set_num_threads(before + 1)  # someone (a Ray worker, a benchmark) chose a count
        assert T.decode_threads() is None
    finally:
        torch.set_num_threads(before)
        T.reset()


def test_timed_step_sets_and_restores_the_count():
    before = torch.get_num_threads()
    gov = T.DecodeThreads(before + 1, first_probe=0, probe_every=4, probe_steps=1)  # probes the most first
    with T.timed_step(gov) as step:
        assert torch.get_num_threads() == step.n == before + 1
    assert torch.get_num_threads() == before and len(gov.times[before + 1]) == 1
    with T.timed_step(3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("weights", ["q8_0", "gguf"])
def test_answers_do_not_depend_on_the_thread_count(weights, monkeypatch):
    # the C kernels give every output the same way on any thread count: a generation whose steps
    # alternate between 1 and 2 threads gives the logits of one on 1 thread, bit for bit
    from ldqa.attention.generate import SamplingConfig, start_generation
    from ldqa.attention.loader import load_model

    lm = load_model("smollm2-135m", weights=weights)
    ids = lm.tokenizer.encode("Question: what is the boiling point of water at sea level? Answer:")

    def tokens_and_logits(threads):
        gen = start_generation(lm.model, ids, lm.tokenizer.decode, [], SamplingConfig(max_new_tokens=12))
        gen.threads = threads
        steps = []
        real = gen.model

        def spy(*a, **k):
            out = real(*a, **k)
            steps.append(out[0, -1].clone())
            return out
        gen.model = spy
        list(gen)
        return gen.token_ids, torch.stack(steps)

    before = torch.get_num_threads()
    try:
        prefills = []
        for n in (1, 2):  # the prefill too (`prefill_on` may run it on either count), 64+ rows: the bf16 GEMM path, probed
            torch.set_num_threads(n)
            prefills.append(start_generation(lm.model, ids * 8, lm.tokenizer.decode, [], SamplingConfig()).first_logits)
        torch.set_num_threads(2)
        with T.prefill_on(T.DecodeThreads(2), lm.model) as probe:  # a first answer's prefill: layers on 2, 1, 2, 1
            prefills.append(start_generation(lm.model, ids * 8, lm.tokenizer.decode, [], SamplingConfig()).first_logits)
        assert len(probe.layer_ms) == 2 and probe.chosen in (1, 2)
        c = lm.model.cfg  # the quantized layers count as their matrices do
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        assert T.layer_weights(lm.model.model.layers[0]) == \
            c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
        assert torch.equal(prefills[0], prefills[1]) and torch.equal(prefills[0], prefills[2])
        torch.set_num_threads(before)
        toks1, logits1 = tokens_and_logits(1)
        flip = T.DecodeThreads(2, first_probe=0, probe_every=2, probe_steps=1)  # probes 2 every other step
        toks2, logits2 = tokens_and_logits(flip)
    finally:
        torch.set_num_threads(before)
    assert toks1 == toks2 and torch.equal(logits1, logits2)
    assert len(flip.times[1]) > 0 and len(flip.times[2]) > 0


def test_prefill_runs_on_the_count_the_governor_last_chose():
    before = torch.get_num_threads()
    most = before + 1
    gov = T.DecodeThreads(most, first_probe=4, probe_every=32, probe_steps=2)
    with T.prefill_on(gov):  # nothing measured yet (a first answer): torch's count as it is
        assert torch.get_num_threads() == before
    _run(gov, lambda n: 0.250 if n == most else 0.025, 8)  # busy core: both counts timed, one thread kept
    assert gov.prefill_count() == 1
    with T.prefill_on(gov):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    _run(gov, lambda n: 0.010 if n == most else 0.025, 200)  # the load went: the probes move decode to `most`
    assert gov.best == most and gov.prefill_count() == most
    try:
        with T.prefill_on(gov):
            assert torch.get_num_threads() == most
        assert torch.get_num_threads() == before
        for pinned in (3, None):  # a fixed decode count or the user's: prefill left alone
            with T.prefill_on(pinned):
                assert torch.get_num_threads() == before
        assert T.DecodeThreads(1).prefill_count() is None
    finally:
        torch.set_num_threads(before)


def test_the_app_s_prefill_follows_the_governor(tiny_model_dir, tmp_path, monkeypatch):
    # LongDocQA builds the context (prefill) on the governor's choice and decodes with the same governor
    from ldqa.app.api import LongDocQA, Passage

    start = torch.get_num_threads()
    torch.set_num_threads(2)  # so that a prefill left alone would run on 2, not the governor's 1
    before = 2
    gov = T.DecodeThreads(before + 1, first_probe=4, probe_every=32, probe_steps=2)
    _run(gov, lambda n: 0.025 if n == 1 else 0.250, 8)  # measured: one thread is faster
    monkeypatch.setattr(T, "decode_threads", lambda: gov)
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("llama")), max_new_tokens=4, weights="q8_0")
    seen, real = [], qa.engine.context

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)
    monkeypatch.setattr(qa.engine, "context", spy)
    steps = gov.steps
    try:
        qa.answer("What torque?", [Passage("Bulletin", "Tighten each fan hub bolt to 18 Nm.")], debias="none")
        assert seen == [1] and torch.get_num_threads() == before
    finally:
        qa.store.close()
        torch.set_num_threads(start)
    assert gov.steps > steps  # its decode steps went through the same governor


class _ClockLayer(torch.nn.Module):
    """A stand-in decoder layer whose call advances a fake clock by cost(torch's thread count) ms; it counts
    as `weights` weights per row (`threads.layer_weights`)."""

    def __init__(self, clock, cost, weights: int = 5_600_000):
        super().__init__()
        self.clock, self.cost = clock, cost
        self.in_features, self.out_features = 1000, weights // 1000

    def forward(self, x):
        self.clock[0] += self.cost(torch.get_num_threads()) / 1e3
        return x


@pytest.mark.parametrize("busy", [True, False])
def test_a_first_prefill_probes_layer_pairs_and_keeps_the_faster_count(busy, monkeypatch):
    from types import SimpleNamespace

    before = torch.get_num_threads()
    most = before + 1
    clock = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    cost = (lambda n: 300.0 if n == most else 170.0) if busy else (lambda n: 100.0 if n == most else 160.0)
    layers = torch.nn.ModuleList(_ClockLayer(clock, cost) for _ in range(8))
    model = SimpleNamespace(cfg=SimpleNamespace(layer_types=["sliding"] * 5 + ["full"] * 3),
                            model=SimpleNamespace(layers=layers))
    gov = T.DecodeThreads(most)  # nothing measured yet: a process's first answer
    used = []
    rows = -(-int(T.PROBE_MIN_MACS) // T.layer_weights(layers[0]))  # the fewest rows worth timing: 63
    try:
        with T.prefill_on(gov, model) as p:
            for layer in layers:
                layer(torch.zeros(1, rows, 4))
                used.append(torch.get_num_threads())
            assert p.chosen == (1 if busy else most)
            layer(torch.zeros(1, 8, 4))  # later calls: no hooks left
        assert torch.get_num_threads() == before
        # layers 0-3 (sliding) probe most, 1, most, 1; then every layer runs on the choice
        assert sorted(p.layer_ms) == [("sliding", 1), ("sliding", most)]
        assert all(len(v) == T.PROBE_PAIRS for v in p.layer_ms.values())
        assert used[4:] == [p.chosen] * 4 and all(not layer._forward_pre_hooks for layer in layers)
        # a short prefill (the question alone) is not probed; a governor that has measured is followed
        with T.prefill_on(T.DecodeThreads(most), model) as q:
            layers[0](torch.zeros(1, rows - 1, 4))
            assert q.chosen is None and not q.layer_ms and torch.get_num_threads() == before
        _run(gov, lambda n: 0.250 if n == most else 0.025, 8)
        with T.prefill_on(gov, model) as r:
            assert torch.get_num_threads() == 1 and r.model is None  # the governor's choice, no probe
    finally:
        torch.set_num_threads(before)


def test_short_passes_of_a_large_model_are_probed_and_a_batch_counts_whole(monkeypatch):
    """The probe's threshold is work, not rows: the question's ~25 rows through a layer of 47M weights (Qwen2.5
    1.5B's) are timed, through one of 5.6M (Gemma 3 270M's) they are not, unless a batch of orders makes the
    call large enough (rows = batch x tokens)."""
    from types import SimpleNamespace

    before = torch.get_num_threads()
    most = before + 1
    clock = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])

    def probed(weights, shape):
        layers = torch.nn.ModuleList(_ClockLayer(clock, lambda n: 300.0 if n == most else 170.0, weights)
                                     for _ in range(4))
        model = SimpleNamespace(cfg=SimpleNamespace(layer_types=None), model=SimpleNamespace(layers=layers))
        with T.prefill_on(T.DecodeThreads(most), model) as p:
            for layer in layers:
                layer(torch.zeros(*shape, 4))
        return p.chosen

    try:
        assert probed(47_000_000, (1, 25)) == 1  # a busy core found within the question's own pass
        assert probed(5_600_000, (1, 25)) is None
        assert probed(5_600_000, (2, 40)) == 1  # 80 rows
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
