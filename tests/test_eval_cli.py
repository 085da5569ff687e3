"""`ldqa eval` (ldqa.eval.harness): metrics worked by hand, mode specs, resume from the SQLite cache, and a
tiny end-to-end run of every benchmark (and the transformers reference mode) with a random-weight Gemma 3.
The runs go through `ldqa.app.cli.main` in-process (the console script itself is covered by test_cli.py)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from ldqa.app.api import LongDocQA
from ldqa.app.cli import main
from ldqa.eval import harness
from ldqa.eval.answering import rank_metrics
from ldqa.eval.harness import Mode, gold_positions, parse_modes
from ldqa.eval.metrics import best_subspan_em, exact_match, normalize_answer, token_f1


# ------------------------------------------------------------------------------------------ metrics

def test_normalization_edge_cases():
    assert normalize_answer("The Beatles!") == "beatles"  # article + punctuation
    assert normalize_answer("A  cat's toy.") == "cats toy"  # apostrophe dropped, white space folded
    assert normalize_answer("Theater of the Absurd") == "theater of absurd"  # 'the' only as a word
    assert normalize_answer("1956\u20141972") == "1956\u20141972"  # an em dash is not ASCII punctuation: kept
    assert normalize_answer("") == ""
    # unicode: a decomposed accent (e + U+0301) matches the composed one (the metrics apply NFC)
    assert exact_match("Cafe\u0301 Müller", ["Café Müller"]) == 1.0
    assert token_f1("Wilhelm Conrad Ro\u0308ntgen", ["Wilhelm Conrad Röntgen"]) == 1.0
    # empty prediction scores 0 under every metric; multiple gold answers: the best one counts
    assert best_subspan_em("", ["x"]) == exact_match("", ["x"]) == token_f1("", ["x"]) == 0.0
    assert best_subspan_em("in 1889, by Eiffel", ["1890", "1889"]) == 1.0
    assert exact_match("an Eiffel tower", ["Gustave Eiffel", "the eiffel tower"]) == 1.0


def test_longbench_f1_by_hand():
    # LongBench qa_f1_score = SQuAD normalization + token F1, max over the answers (THUDM/LongBench metrics.py).
    # 1. pred [eiffel, tower, is, in, paris] (5), gold [paris, france] (2), common {paris}: p = 1/5, r = 1/2,
    #    F1 = 2 * (1/10) / (7/10) = 2/7.
    assert token_f1("The Eiffel Tower is in Paris.", ["Paris, France"]) == pytest.approx(2 / 7)
    # 2. pred [marie, curie, and, pierre, curie] (5); gold A [marie, curie]: common 2, p = 2/5, r = 1, F1 = 4/7;
    #    gold B [pierre, and, marie, curie]: common 4 (curie counted once), p = 4/5, r = 1, F1 = 8/9 -> max 8/9.
    assert token_f1("Marie Curie and Pierre Curie", ["Marie Curie", "Pierre and Marie Curie"]) == pytest.approx(8 / 9)
    # 3. repeated tokens: "a dog a dog a dog" -> [dog, dog, dog]; gold [dog]: common 1, p = 1/3, r = 1, F1 = 1/2.
    assert token_f1("a dog a dog a dog", ["The dog"]) == pytest.approx(0.5)
    # 4. no token in common -> 0.
    assert token_f1("London", ["Paris"]) == 0.0


def test_rank_metrics_by_hand():
    # retrieved chunks of documents [7, 3, 3, 9]: documents [7, 3, 9], the gold 9 at rank 3
    m = rank_metrics([7, 3, 3, 9], 9)
    assert m["gold_rank"] == 3 and (m["recall@1"], m["recall@5"], m["recall@10"]) == (0.0, 1.0, 1.0)
    assert m["mrr@10"] == pytest.approx(1 / 3) and m["ndcg@10"] == pytest.approx(1 / math.log2(4))
    assert rank_metrics([1, 2], 5) == {"recall@1": 0.0, "recall@5": 0.0, "recall@10": 0.0, "gold_rank": None,
                                            "mrr@10": 0.0, "ndcg@10": 0.0}


# ------------------------------------------------------------------------------------------ mode specs

def test_mode_specs_cross_product(monkeypatch):
    ms = parse_modes("full,block", "none,calibrate")
    assert [m.label for m in ms] == ["full", "full/calibrate", "block", "block/calibrate"]
    # debiasing does not apply to retrieval attention or the hf reference: that axis collapses
    assert [m.label for m in parse_modes("retrieval,hf", "none,calibrate")] == ["retrieval", "hf"]
    # the retriever axis only exists for the retrieval benchmark; an item may name its own settings
    ms = parse_modes("full,block/sort@dense", retriever="hybrid,bm25", benchmark="retrieval")
    assert [m.label for m in ms] == ["full@hybrid", "full@bm25", "block/sort@dense"]
    assert ms[2] == Mode("block", "sort", "dense") and ms[2].key == "block/sort@dense"
    assert Mode("full").key == "full/none@-"
    # the cache key of retrieval attention carries its settings: a changed default is not read back stale
    from ldqa.attention.retrieval_attention import RetrievalConfig

    r = Mode("retrieval")
    assert harness.mode_cache_key(Mode("full")) == "full/none@-"
    assert harness.mode_cache_key(r).startswith("retrieval/none@-#")
    assert harness.mode_cache_key(r) == harness.mode_cache_key(r, RetrievalConfig())
    other = RetrievalConfig(top_k_keys=RetrievalConfig().top_k_keys + 1)
    assert harness.mode_cache_key(r, other) != harness.mode_cache_key(r)
    # so does a calibrate method's: its defaults (orders, calibration form) change its answers
    from ldqa.attention import debias

    cal = Mode("block", "calibrate")
    key = harness.mode_cache_key(cal)
    from ldqa.attention.block_attention import DEFAULT_ANCHOR_PASSAGES

    anchor = f"+anchor{DEFAULT_ANCHOR_PASSAGES['block']}" if DEFAULT_ANCHOR_PASSAGES["block"] else ""
    assert key.startswith("block/calibrate@-#") and key.endswith(anchor)
    assert harness.mode_cache_key(Mode("block", "sort")) == "block/sort@-" + anchor
    other_form = "difference" if debias.CALIBRATION["block"] == "ratio" else "ratio"
    monkeypatch.setitem(debias.CALIBRATION, "block", other_form)
    assert harness.mode_cache_key(cal) != key
    assert gold_positions("default", 20) == [1, 5, 10, 15, 20] and gold_positions("default", 10) == [1, 5, 10]
    assert gold_positions("all", 3) == [1, 2, 3] and gold_positions("2", 3) == [2]


@pytest.mark.parametrize("kw, match", [
    (dict(modes="full,fast"), "--modes: unknown mode 'fast'"),
    (dict(modes="full", debias="calibrated"), "--debias: unknown method 'calibrated'"),
    (dict(modes="full", retriever="sparse"), "--retriever: unknown retriever 'sparse'"),
    (dict(modes="hf/calibrate"), "debiasing does not apply to the hf mode"),
    (dict(modes=" , "), "--modes is empty"),
])
def test_bad_mode_specs(kw, match):
    with pytest.raises(ValueError, match=match):
        parse_modes(**kw)


def test_bad_arguments_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="benchmark 'squad' is unknown"):
        harness.run(harness.EvalConfig("squad", str(tmp_path)))
    with pytest.raises(ValueError, match="--data .*missing.jsonl: not found"):
        harness.run(harness.EvalConfig("jsonl", str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="--gold-positions"):
        harness.run(harness.EvalConfig("nq-multidoc", str(tmp_path), n_passages=3, gold_positions="1,4"))
    assert main(["eval", "kv-retrieval", "--data", str(tmp_path / "nope.gz")]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["eval", "niah", "--data", str(tmp_path), "--modes", "full,turbo"]) == 2
    assert "unknown mode 'turbo'" in capsys.readouterr().err
    for skip, limit in ((-1, None), (3, 3)):
        with pytest.raises(ValueError, match="--skip must be >= 0 and below --limit"):
            harness.run(harness.EvalConfig("nq-multidoc", str(tmp_path), skip=skip, limit=limit))


def test_skip_leaves_out_the_head_of_the_seeded_order():
    from ldqa.eval.examples import _sample

    whole = _sample(50, harness.EvalConfig("nq-multidoc", "x", limit=30, seed=3))
    assert _sample(50, harness.EvalConfig("nq-multidoc", "x", limit=30, skip=12, seed=3)) == whole[12:]
    assert _sample(50, harness.EvalConfig("nq-multidoc", "x", skip=45, seed=3))[:5] == \
        _sample(50, harness.EvalConfig("nq-multidoc", "x", seed=3))[45:]


# ------------------------------------------------------------------------------------------ runs

def _eval(bench, data, out, model, *extra):
    argv = ["eval", bench, "--data", str(data), "--out", str(out), "--model", str(model), "--limit", "2",
            "--max-new-tokens", "4", "--no-progress", *map(str, extra)]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def _check_outputs(res, out, n_rows, plots=("ttft_vs_length.png",), max_new=4):
    assert len(res["rows"]) == n_rows
    for name in ("results.json", "results.csv", "summary.md", "predictions.sqlite", *plots):
        assert (out / name).stat().st_size > 0, name
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == n_rows
    summary = (out / "summary.md").read_text()
    for m in res["modes"]:
        assert f"| {m['mode']} |" in summary
        assert m["n"] * len(res["modes"]) == n_rows and 0.0 <= m["accuracy"] <= 1.0
        assert m["ttft_ms"] > 0 and m["peak_mb"] > 0
    for r in res["rows"]:
        assert isinstance(r["prediction"], str) and r["prompt_tokens"] > 0 and r["generated_tokens"] <= max_new


def test_nq_multidoc_with_hf_reference(tmp_path, tiny_model_dir, nq_small):
    model = tiny_model_dir("gemma3")
    out = tmp_path / "nq"
    res = _eval("nq-multidoc", nq_small, out, model, "--modes", "full,block,hf", "--n-passages", "3",
                "--gold-positions", "1,3", "--weights", "fp32")  # hf parity: ldqa's fp32 reference weights
    _check_outputs(res, out, 2 * 2 * 3, plots=("ttft_vs_length.png", "accuracy_vs_position.png"))
    assert [m["mode"] for m in res["modes"]] == ["full", "block", "hf"]
    assert set(res["modes"][0]["by_position"]) == {"1", "3"}
    rows = {(r["example_id"], r["mode"]): r for r in res["rows"]}
    for (ex, mode), r in rows.items():
        assert r["n_passages"] == 3 and r["gold_position"] in (1, 3)
        if mode == "hf":  # transformers' generate on the same prompt ids: same greedy answer, same prompt
            assert r["prediction"] == rows[(ex, "full")]["prediction"]
            assert r["prompt_tokens"] == rows[(ex, "full")]["prompt_tokens"]


def test_kv_retrieval_resume_reuses_cached_answers(tmp_path, tiny_model_dir, shared_data, monkeypatch):
    model = tiny_model_dir("gemma3")
    calls = []
    real = LongDocQA.answer

    def counting(self, question, passages, **kw):
        calls.append(question)
        prompts.append(kw)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt  # an interruption in the middle of a run
        return real(self, question, passages, **kw)

    monkeypatch.setattr(LongDocQA, "answer", counting)
    stop_at, prompts = [0], []
    data = shared_data / "kv-retrieval-75_keys.jsonl.gz"
    kv = ("--kv-keys", "4", "--depths", "0,100")
    out = tmp_path / "kv"
    first = _eval("kv-retrieval", data, out, model, *kv)
    _check_outputs(first, out, 2 * 2, plots=("ttft_vs_length.png", "accuracy_vs_position.png"))
    assert len(calls) == 4 and first["computed"] == 4 and first["cached"] == 0
    r0 = first["rows"][0]
    assert r0["n_records"] == 4 and r0["position"] == 1 and r0["question"].startswith('What is the value of key "')
    key0 = r0["question"].split('"')[1]  # the task's instruction, and the answer started for the model
    assert prompts[0]["instruction"] == harness.KV_INSTRUCTION
    assert prompts[0]["answer_prefix"] == f'The value of key "{key0}" is "'

    calls.clear()
    second = _eval("kv-retrieval", data, out, model, *kv, "--limit", "3")  # the later --limit wins
    assert len(calls) == 2 and second["computed"] == 2 and second["cached"] == 4
    assert second["rows"][:4] == first["rows"]  # same rows, same created_at: read back, not recomputed

    # interrupted after one new answer, then resumed: identical to an uninterrupted run
    calls.clear()
    stop_at[0] = 2
    with pytest.raises(KeyboardInterrupt):
        _eval("kv-retrieval", data, tmp_path / "kv2", model, *kv, "--limit", "3")
    stop_at[0] = 0
    calls.clear()
    resumed = _eval("kv-retrieval", data, tmp_path / "kv2", model, *kv, "--limit", "3")
    assert len(calls) == 5 and resumed["cached"] == 1
    key = lambda rows: [(r["example_id"], r["mode"], r["prediction"], r["score"]) for r in rows]  # noqa: E731
    assert key(resumed["rows"]) == key(second["rows"])


def test_kv_retrieval_hf_reference_gets_the_same_prompt(tmp_path, tiny_model_dir, shared_data):
    model = tiny_model_dir("gemma3")
    out = tmp_path / "kv-hf"
    res = _eval("kv-retrieval", shared_data / "kv-retrieval-75_keys.jsonl.gz", out, model, "--kv-keys", "4",
                "--depths", "50", "--limit", "1", "--modes", "full,hf", "--weights", "fp32")
    full, hf = res["rows"]
    assert (full["mode"], hf["mode"]) == ("full", "hf")
    assert hf["prompt_tokens"] == full["prompt_tokens"] and hf["prediction"] == full["prediction"]
    # that prompt carries the task's instruction and answer prefix (and differs from the plain QA prompt)
    from ldqa.app.api import Passage
    from ldqa.app.prompt import build_prompt
    from ldqa.attention.loader import load_tokenizer

    tok = load_tokenizer(str(model))
    ex = harness._kv(harness.EvalConfig("kv-retrieval", str(shared_data / "kv-retrieval-75_keys.jsonl.gz"),
                                        limit=1, depths="50", kv_keys=4), None)[0]
    ps = [Passage.of(p) for p in ex["passages"]]
    assert full["prompt_tokens"] == len(build_prompt(tok, ps, ex["question"], ex["instruction"], ex["answer_prefix"]))
    assert full["prompt_tokens"] != len(build_prompt(tok, ps, ex["question"]))


def test_niah_grid_and_heatmap(tmp_path, tiny_model_dir, shared_data):
    model = tiny_model_dir("gemma3")
    out = tmp_path / "niah"
    res = _eval("niah", shared_data / "pg-essays", out, model, "--lengths", "300", "--depths", "0,100",
                "--passage-tokens", "128")
    _check_outputs(res, out, 2, plots=("ttft_vs_length.png", "niah_heatmap.png"))
    assert [(r["length"], r["depth"]) for r in res["rows"]] == [(300, 0), (300, 100)]
    assert all(r["n_passages"] == 3 for r in res["rows"])  # 300 tokens in passages of 128, the needle whole
    assert set(res["modes"][0]["grid"]) == {"300@0", "300@100"}


def test_retrieval_benchmark(tmp_path, tiny_model_dir, nq_small):
    model = tiny_model_dir("gemma3")
    out = tmp_path / "ret"
    res = _eval("retrieval", nq_small, out, model, "--retriever", "bm25,dense", "--top-k", "2")
    _check_outputs(res, out, 2 * 2)
    assert [m["mode"] for m in res["modes"]] == ["full@bm25", "full@dense"]
    for m in res["modes"]:
        assert {"recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10"} <= set(m)
        assert m["recall@10"] == 1.0  # 12 documents: the gold one is always in the top 10
    bm25 = [r for r in res["rows"] if r["mode"] == "full@bm25"]
    assert all(r["gold_rank"] == 1 for r in bm25)  # a question's own passage shares its words
    assert all(r["n_passages"] == 2 for r in res["rows"])
    assert "recall@1" in (out / "summary.md").read_text()


def test_jsonl_longbench_format(tmp_path, tiny_model_dir):
    model = tiny_model_dir("gemma3")
    data = tmp_path / "longbench.jsonl"
    records = [
        {"_id": "a1", "input": "Which river flows through Vienna?", "answers": ["Danube"], "all_classes": None,
         "length": 40, "context": "Vienna is the capital of Austria. The Danube flows through the city. " * 8},
        {"_id": "b2", "input": "What colour is the kiln?", "answers": ["blue", "dark blue"], "all_classes": None,
         "length": 12, "context": "The kiln was repainted blue in May."},
        {"question": "Who wrote the note?", "answers": ["Ada"],
         "passages": [{"title": "Note", "text": "Ada wrote the note."}, "An unrelated passage."]},
    ]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "jsonl"
    res = _eval("jsonl", data, out, model, "--limit", "3", "--passage-tokens", "64")
    _check_outputs(res, out, 3)
    assert res["metric"].startswith("token F1")
    rows = {r["example_id"]: r for r in res["rows"]}
    assert set(rows) == {"a1", "b2", "line3"}
    assert rows["a1"]["n_passages"] > 1 and rows["b2"]["n_passages"] == 1 and rows["line3"]["n_passages"] == 2
    for r in rows.values():
        assert r["score"] == pytest.approx(token_f1(r["prediction"], r["answers"]))


@pytest.mark.slow
def test_every_benchmark_end_to_end_with_the_real_model(tmp_path, nq_small, shared_data):
    """Each benchmark on a few examples with Gemma 3 270M (real weights), `hf` beside `full` where it
    applies: transformers' generate on the same prompt must give the same greedy answers."""
    model = "gemma3-270m"
    res = _eval("nq-multidoc", nq_small, tmp_path / "nq", model, "--modes", "full,block,hf", "--n-passages", "3",
                "--gold-positions", "1,3", "--max-new-tokens", "12", "--weights", "fp32")
    _check_outputs(res, tmp_path / "nq", 2 * 2 * 3, plots=("ttft_vs_length.png", "accuracy_vs_position.png"),
                   max_new=12)
    rows = {(r["example_id"], r["mode"]): r for r in res["rows"]}
    for (ex, mode), r in rows.items():
        if mode == "hf":
            assert r["prediction"] == rows[(ex, "full")]["prediction"] != ""

    # 4 key-value pairs: the model copies the queried value (the answer prefix starts it off)
    res = _eval("kv-retrieval", shared_data / "kv-retrieval-75_keys.jsonl.gz", tmp_path / "kv", model,
                "--kv-keys", "4", "--depths", "0", "--modes", "full,hf", "--max-new-tokens", "48", "--limit", "1",
                "--weights", "fp32")
    by_mode = {r["mode"]: r for r in res["rows"]}
    full, hf = by_mode["full"], by_mode["hf"]
    assert full["score"] == 1.0 and hf["prediction"] == full["prediction"]

    res = _eval("niah", shared_data / "pg-essays", tmp_path / "niah", model, "--lengths", "512", "--depths", "50",
                "--modes", "full,retrieval", "--max-new-tokens", "12")
    _check_outputs(res, tmp_path / "niah", 2, plots=("ttft_vs_length.png", "niah_heatmap.png"), max_new=12)
    assert len({r["prediction"] for r in res["rows"]}) == 1  # 512 tokens: under min_indexed, exact attention

    res = _eval("retrieval", nq_small, tmp_path / "ret", model, "--retriever", "dense,bm25", "--max-new-tokens", "8")
    assert {m["mode"] for m in res["modes"]} == {"full@dense", "full@bm25"}
    assert all(r["gold_rank"] is not None for r in res["rows"])  # 12 documents: each gold within the top 10

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"_id": "v", "input": "Which river flows through Vienna?", "answers": ["Danube"],
                                "context": "Vienna is the capital of Austria. The Danube flows through the city."})
                    + "\n")
    res = _eval("jsonl", data, tmp_path / "jsonl", model, "--max-new-tokens", "8")
    assert res["rows"][0]["prediction"] != ""
