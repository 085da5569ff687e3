import pytest
import torch

from ldqa.attention.generate import SamplingConfig, sample, start_generation
from ldqa.attention.loader import load_model


def test_sampling_rules():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingConfig(temperature=0.0), None) == 1
    # top_p small keeps only the most likely token: sampling then equals greedy whatever the seed
    for seed in range(5):
        assert sample(logits, SamplingConfig(temperature=1.0, top_p=0.01), torch.Generator().manual_seed(seed)) == 1
    draws = [sample(logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(s)) for s in range(200)]
    assert set(draws) >= {1, 2}  # both near-tied tokens are drawn at temperature 1
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_seeded_generation_is_deterministic_and_stops(tiny_model_dir):
    lm = load_model(str(tiny_model_dir("llama")))
    ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode("The kiln dries oak boards")

    def run(cfg, eos=()):
        gen = start_generation(lm.model, ids, lm.tokenizer.decode, eos, cfg)
        pieces = [d for _, d in gen]
        return gen, "".join(pieces)

    cfg = SamplingConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    a, ta = run(cfg)
    b, tb = run(cfg)
    assert a.token_ids == b.token_ids and ta == a.text
    assert a.stats.generated_tokens == 12 and a.stats.stop_reason == "max_new_tokens"
    first = a.token_ids[0]
    c, _ = run(cfg, eos=[first])  # the first sampled token is an EOS id: nothing is generated
    assert c.token_ids == [] and c.stats.stop_reason == "eos"
    assert a.stats.ttft_ms > 0 and a.stats.prompt_tokens == len(ids)


def test_stream_never_shows_part_of_a_stop_string():
    from ldqa.attention.generate import Generation, GenerationStats

    pieces = ["  18", " Nm", "\n", "Ques", "tion", ":", " more"]
    vocab = {i: p for i, p in enumerate(pieces)}

    class FakeModel:  # emits token i at step i
        def __call__(self, tokens, positions, cache):
            step = int(positions[0]) + 1
            out = torch.full((1, 1, len(pieces)), -1e9)
            out[0, 0, min(step, len(pieces) - 1)] = 0.0
            return out

    class FakeCache:
        n = 0

        def next_position(self):
            self.n += 1
            return self.n - 1

    first = torch.full((1, 1, len(pieces)), -1e9)
    first[0, 0, 0] = 0.0
    gen = Generation(FakeModel(), lambda ids: "".join(vocab[i] for i in ids), set(),
                     SamplingConfig(max_new_tokens=10, stop_strings=("\nQuestion:",)), FakeCache(), first,
                     GenerationStats(), 0.0)
    out = [d for _, d in gen]
    assert "".join(out) == "18 Nm" == gen.text
    assert not any("\n" in d for d in out)
    assert gen.stats.stop_reason == "stop_string"
