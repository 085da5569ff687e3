"""APE-style block scaling (`block_attention.ScaledKV`) and the benchmarks of block+recompute's token
selection (`eval/bench/bench_recompute.py`) and of the scaling's fit (`eval/bench/bench_block_scaling.py`)."""

from __future__ import annotations

import math

import pytest
import torch

from ldqa.app.prompt import build_prompt
from ldqa.attention.block_attention import BlockRuntime, BlockScaling, ScaledKV
from ldqa.attention.loader import load_model

from .conftest import SHARED_DATA

PASSAGES = [{"title": "Kiln manual", "text": "The SL-30 chamber holds 3.2 cubic metres of stacked lumber. " * 3},
            {"title": "Bulletin", "text": "Tighten each fan hub bolt to 18 Nm with a calibrated wrench. " * 4}]


class _P:
    def __init__(self, d):
        self.title, self.text, self.page = d["title"], d["text"], None


def _reference(q, k, v, q_pos, k_pos, start, end, query_from, t, s, scale):
    """Loops over heads, rows and keys: the scaled softmax attention written out."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(q.shape[2]):
            w = []
            for j in range(k.shape[2]):
                if k_pos[j] > q_pos[i]:
                    w.append(-math.inf)
                    continue
                x = float(q[0, h, i] @ k[0, kv, j]) * scale
                if q_pos[i] >= query_from and start <= j < end:
                    x = x / t + math.log(s)
                w.append(x)
            p = torch.softmax(torch.tensor(w), 0)
            out[0, h, i] = p @ v[0, kv]
    return out


@pytest.mark.parametrize("t, s", [(1.0, 1.0), (0.8, 2.0), (1.3, 0.25)])
def test_scaled_attention_equals_the_written_out_formula(t, s):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g),
               torch.randn(1, 2, 12, 8, generator=g))
    q_pos, k_pos = torch.tensor([7, 10, 11]), torch.arange(12)  # row 0 is a passage token (before query_from)
    pol = ScaledKV(BlockScaling(t, s), start=2, end=9, query_from=9, attn_scale=0.35)
    got = pol.forward(0, q, k, v, q_pos, k_pos, None)
    assert torch.allclose(got, _reference(q, k, v, q_pos, k_pos, 2, 9, 9, t, s, 0.35), atol=1e-5)
    assert pol.forward(0, q[:, :, :1], k, v, q_pos[:1], k_pos, None) is None  # no query to scale: exact path


def test_identity_scaling_gives_plain_block_attention_s_logits(tiny_model_dir):
    lm = load_model(str(tiny_model_dir("qwen2")))
    seg = build_prompt(lm.tokenizer, [_P(p) for p in PASSAGES], "How much lumber does the chamber hold?")
    rt = BlockRuntime(lm.model, "fp")
    cache, _ = rt.assemble(seg, [None] * 2, mode="block")
    end, q = cache.length, seg.question
    plain = lm.model(torch.tensor([q]), torch.arange(end, end + len(q)), cache.clone(), all_logits=True)
    scaled = cache.clone()
    scaled.policy = ScaledKV(BlockScaling(), len(seg.prefix), end, end, lm.model.cfg.attn_scale)
    same = lm.model(torch.tensor([q]), torch.arange(end, end + len(q)), scaled, all_logits=True)
    assert (plain - same).abs().max().item() < 1e-4
    scaled = cache.clone()
    scaled.policy = ScaledKV(BlockScaling(1.0, 1e-6), len(seg.prefix), end, end, lm.model.cfg.attn_scale)
    other = lm.model(torch.tensor([q]), torch.arange(end, end + len(q)), scaled, all_logits=True)
    assert (plain - other).abs().max().item() > 1e-3  # passages all but hidden: another answer


def test_block_scaling_refuses_non_positive_values():
    for bad in ((0.0, 1.0), (1.0, -1.0)):
        with pytest.raises(ValueError, match="temperature > 0 and scale > 0"):
            BlockScaling(*bad)


@pytest.mark.bench
def test_bench_recompute_variants_and_paired_summary():
    from ldqa.eval.bench.bench_recompute import markdown, parse_variant, summarize

    assert parse_variant("full") == {"attention": "full"}
    assert parse_variant("question@0.2") == {"attention": "block+recompute", "recompute_select": "question",
                                             "recompute_ratio": 0.2}
    assert parse_variant("oracle")["recompute_select"] == "oracle"
    assert parse_variant("question@0.3/layers=14,window=8,score=max,skip_first=1") == {
        "attention": "block+recompute", "recompute_select": "question", "recompute_ratio": 0.3,
        "select_layers": 14, "select_window": 8, "select_score": "max", "select_skip_first": True}
    assert parse_variant("question@0.3/max_tokens=512")["recompute_max_tokens"] == 512
    assert parse_variant("question@0.3/whole=1")["select_whole"] == 1
    assert parse_variant("question@0.3/refine=0.1")["select_refine"] == 0.1
    for bad in ("question@0.3/max_tokens=-1", "question@0.3/max_tokens=x", "question@2", "random@0.1", "question",
                "question@0.3/layers=0", "question@0.3/layers=x",
                "question@0.3/score=median", "question@0.3/14", "question@0.3/skip_first=2", "question@0.3/whole=-1", "question@0.3/refine=2",
                "lead@0.1/window=4"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)
    done = {}
    for i, (f, b) in enumerate([(1, 0), (1, 1), (0, 0), (1, 0)]):
        for spec, em in (("full", f), ("block", b)):
            done[(i, 1, spec)] = {"i": i, "gold_position": 1, "variant": spec, "prediction": str(em) + spec,
                                  "em": em, "ttft_ms": 100.0, "prompt_tokens": 50, "generated_tokens": 3,
                                  "at_cap": False, "tokens_recomputed": 0}
    s = summarize(done, [0, 1, 2, 3], [1], ["full", "block"])
    assert s["full"]["em"] == 0.75 and s["block"]["em"] == 0.25
    assert s["block"]["minus_full_points"] == -50.0 and s["block"]["n_paired"] == 4
    assert s["block"]["paired_se_points"] == pytest.approx(100 * 0.57735 / 2, rel=1e-4)
    assert "| block | 0.250 | 0.250 | -50.0 (28.9) | 0/4 |" in markdown(s, [1])


@pytest.mark.bench
@pytest.mark.skipif(not (SHARED_DATA / "nq-open-oracle.jsonl.gz").exists(), reason="needs ../shared/data")
def test_bench_block_scaling_runs_the_grid_with_plain_block_as_reference(tmp_path, tiny_model_dir, capsys):
    import json

    from ldqa.eval.bench.bench_block_scaling import main

    out = tmp_path / "o"
    assert main(["--model", str(tiny_model_dir("qwen2")), "--n", "2", "--temperatures", "0.9",
                 "--scales", "0.5", "--new-tokens", "2", "--layouts", "sequential,parallel", "--out", str(out)]) == 0
    res = json.loads((out / "bench-block-scaling.json").read_text())
    assert {(r["layout"], r["temperature"], r["scale"]) for r in res["grid"]} == {
        (lay, t, s) for lay in ("sequential", "parallel") for t, s in ((0.9, 0.5), (1.0, 1.0))}
    assert res["plain_block"]["layout"] == "sequential" and res["plain_block"]["kl"] >= 0
    assert res["best"]["kl"] <= res["plain_block"]["kl"]
    assert "| layout | temperature | scale |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--layouts"):
        main(["--model", str(tiny_model_dir("qwen2")), "--layouts", "diagonal", "--out", str(out)])


def test_parallel_layout_keeps_each_passage_where_it_was_encoded(tiny_model_dir):
    """APE's parallel layout: every passage at the positions right after the prefix, the blocks as stored;
    with one passage it is block mode's sequential cache, slot for slot."""
    import torch

    from ldqa.attention.segments import PromptSegments
    from ldqa.eval.bench.bench_block_scaling import parallel_blocks

    lm = load_model(str(tiny_model_dir("qwen2")))
    rt = BlockRuntime(lm.model, "fp")
    seg = PromptSegments(prefix=[1, 5, 6], headers=[[7, 8], [7, 9]], passages=[[20, 21, 22, 23], [30, 31, 32]],
                         question=[40, 41])
    cache, top = parallel_blocks(rt, seg)
    assert cache.length == 3 + 6 + 5 and top == 3 + 6
    assert cache.positions.tolist() == [0, 1, 2] + list(range(3, 9)) + list(range(3, 8))
    one = PromptSegments(prefix=seg.prefix, headers=seg.headers[:1], passages=seg.passages[:1], question=[40])
    par, _ = parallel_blocks(rt, one)
    seq, _ = rt.assemble(one, [None], mode="block")
    assert torch.equal(par.positions, seq.positions)
    for layer in range(lm.model.cfg.num_layers):
        assert torch.equal(par.keys(layer), seq.keys(layer)) and torch.equal(par.values(layer), seq.values(layer))


@pytest.mark.bench
@pytest.mark.skipif(not (SHARED_DATA / "nq-open-oracle.jsonl.gz").exists(), reason="needs ../shared/data")
def test_bench_recompute_kl_part_is_zero_when_every_token_is_recomputed(tmp_path, tiny_model_dir, capsys):
    import json

    from ldqa.eval.bench.bench_recompute import main

    out = tmp_path / "o"
    assert main(["--part", "kl", "--model", str(tiny_model_dir("qwen2")), "--n", "2", "--new-tokens", "3",
                 "--variants", "full,block,question@1.0,question@0.3/layers=1", "--out", str(out)]) == 0
    res = json.loads((out / "kl.json").read_text())["variants"]
    assert set(res) == {"block", "question@1.0", "question@0.3/layers=1"}
    assert res["question@1.0"]["kl"] < 1e-4 and res["question@1.0"]["top1_agreement"] == 1.0
    assert res["block"]["kl"] > res["question@1.0"]["kl"] and res["block"]["mean_tokens_recomputed"] == 0
    assert 0 < res["question@0.3/layers=1"]["mean_tokens_recomputed"] < res["question@1.0"]["mean_tokens_recomputed"]
    assert "| question@1.0 |" in capsys.readouterr().out


def test_bench_recompute_variants_take_anchor_passages():
    from ldqa.eval.bench.bench_recompute import parse_variant, split_variants

    specs = split_variants("full,block,block/anchor=3,question@0.3/measured=1,anchor=2,question@0.3")
    assert specs == ["full", "block", "block/anchor=3", "question@0.3/measured=1,anchor=2", "question@0.3"]
    assert parse_variant("block/anchor=3") == {"attention": "block", "anchor_passages": 3}
    assert parse_variant("block/anchor=2,measured=1") == {"attention": "block", "anchor_passages": 2, "measured": True}
    assert parse_variant("block/measured=1") == {"attention": "block", "measured": True}
    assert parse_variant("block/measured=1,batch_orders=0")["batch_orders"] is False
    assert parse_variant("question@0.3/measured=1,batch_orders=0")["batch_orders"] is False
    assert split_variants("full,block/measured=1,batch_orders=0,block/measured=1") == [
        "full", "block/measured=1,batch_orders=0", "block/measured=1"]
    assert parse_variant("question@0.3/measured=1,anchor=2")["anchor_passages"] == 2
    with pytest.raises(ValueError, match="anchor=N"):
        parse_variant("block/anchor=x")
    assert parse_variant("question@0.3/debias=calibrate")["debias"] == "calibrate"
    assert parse_variant("block/debias=calibrate+reorder") == {"attention": "block", "debias": "calibrate+reorder"}
    for bad in ("question@0.3/debias=sort", "block/debias=none"):
        with pytest.raises(ValueError, match="debias=M"):
            parse_variant(bad)


@pytest.mark.bench
@pytest.mark.skipif(not (SHARED_DATA / "nq-open-oracle.jsonl.gz").exists(), reason="needs ../shared/data")
def test_bench_recompute_ttft_part_times_each_variant_against_full(tmp_path, tiny_model_dir, capsys):
    import json

    from ldqa.eval.bench.bench_recompute import main

    out = tmp_path / "o"
    variants = ["full", "block/measured=1,batch_orders=0", "block/measured=1", "question@0.3/measured=1",
                "question@0.3/debias=calibrate"]
    assert main(["--part", "ttft", "--model", str(tiny_model_dir("qwen2")), "--n", "1", "--repeats", "1",
                 "--passages", "3", "--variants", ",".join(variants), "--out", str(out)]) == 0
    res = json.loads((out / "ttft-3.json").read_text())
    assert list(res["median_ttft_ms"]) == variants and set(res["full_over_variant"]) == set(variants[1:])
    assert all(t > 0 for t in res["median_ttft_ms"].values()) and res["median_prompt_tokens"] > 0
    assert res["timed_runs_encoding"] == 0  # block+recompute's blocks (no anchor passages) stored before timing
    assert "| block/measured=1 |" in capsys.readouterr().out


@pytest.mark.bench
@pytest.mark.skipif(not (SHARED_DATA / "nq-open-oracle.jsonl.gz").exists(), reason="needs ../shared/data")
def test_bench_recompute_ttft_part_decodes_the_asked_tokens(tmp_path, tiny_model_dir, monkeypatch):
    """--decode-tokens N: every answer of the ttft part (the warm-up ones too) generates up to N tokens, so
    the decode thread governor sees steps as in an app; 0 is refused. --profile lists each variant's ops."""
    import json

    from ldqa.app.api import LongDocQA
    from ldqa.eval.bench.bench_recompute import main

    asked = []
    real = LongDocQA.answer

    def spy(self, *a, **kw):
        asked.append(kw.get("max_new_tokens"))
        return real(self, *a, **kw)

    monkeypatch.setattr(LongDocQA, "answer", spy)
    out = tmp_path / "o"
    assert main(["--part", "ttft", "--model", str(tiny_model_dir("qwen2")), "--n", "1", "--repeats", "1",
                 "--passages", "3", "--decode-tokens", "3", "--variants", "full,block", "--out", str(out),
                 "--profile"]) == 0
    assert asked and set(asked) == {3}
    res = json.loads((out / "ttft-3.json").read_text())
    assert res["decode_tokens"] == 3
    # --profile: each variant's costliest ops; a block answer multiplies matrices too
    assert set(res["profile"]) == {"full", "block"} and all(res["profile"].values())
    assert any("mm" in op or "linear" in op for op in res["profile"]["block"])
    with pytest.raises(SystemExit, match="--decode-tokens 0"):
        main(["--part", "ttft", "--decode-tokens", "0", "--out", str(out)])


@pytest.mark.bench
@pytest.mark.skipif(not (SHARED_DATA / "nq-open-oracle.jsonl.gz").exists(), reason="needs ../shared/data")
def test_bench_block_ttft_part_runs_full_attention_exactly_and_takes_the_recipe(tmp_path, tiny_model_dir, monkeypatch):
    """bench_block --part ttft: every full-attention run is an exact prefill (the memo cleared first), every
    answer uses --debias, and block+recompute runs at --recompute-ratio."""
    import json

    from ldqa.app.api import LongDocQA
    from ldqa.attention.engine import Engine
    from ldqa.eval.bench.bench_block import main

    cleared, asked = [], []
    real_clear, real_answer = Engine.clear_memo, LongDocQA.answer
    monkeypatch.setattr(Engine, "clear_memo", lambda self: (cleared.append(1), real_clear(self))[1])
    monkeypatch.setattr(LongDocQA, "answer", lambda self, *a, **kw: (asked.append(kw), real_answer(self, *a, **kw))[1])
    out = tmp_path / "o"
    assert main(["--part", "ttft", "--model", str(tiny_model_dir("qwen2")), "--sizes", "600", "--repeats", "2",
                 "--recompute-ratio", "0.2", "--out", str(out)]) == 0
    row = json.loads((out / "results-ttft.json").read_text())["ttft"][0]
    assert set(row["median_ttft_ms"]) == {"full", "block_cold", "block_warm", "block_warm_fresh_headers",
                                          "block+recompute@0.2_warm"}
    assert row["runs"] == 2 and len(cleared) == 2  # one clear per full-attention run
    assert {kw["debias"] for kw in asked} == {"none"}
    recompute = [kw for kw in asked if kw["attention"] == "block+recompute"]
    assert len(recompute) == 4 and {kw["recompute_ratio"] for kw in recompute} == {0.2}  # an untimed run first
