"""bench_runtime on a tiny model without llama.cpp: rows, ratios against fp32, the JSON and table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ldqa.eval.bench import bench_runtime

pytestmark = pytest.mark.bench


def test_bench_runtime_rows_and_ratios(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    d = str(tiny_model_dir("llama"))
    out = tmp_path / "out"
    assert bench_runtime.main(["--model", d, "--formats", "fp32,int8", "--threads", "1", "--lengths", "48",
                               "--new-tokens", "4", "--repeats", "2", "--no-llama", "--out", str(out)]) == 0
    res = json.loads((out / "bench-runtime.json").read_text())
    rows = {r["engine"]: r for r in res["rows"]}
    assert set(rows) == {"ldqa fp32", "ldqa int8"}
    fp32, int8 = rows["ldqa fp32"], rows["ldqa int8"]
    assert fp32["decode_vs_ldqa fp32"] == 1.0 and "decode_vs_llama.cpp" not in fp32
    assert int8["resident_bytes"] < fp32["resident_bytes"] and int8["bytes_per_token"] < fp32["bytes_per_token"]
    assert len(fp32["tokens"]) == 4 and fp32["same_tokens_as_first"] == 4
    assert fp32["bandwidth_limit_tok_s"] > 0 and fp32["ttft_ms"] > 0
    assert "| 48 | 1 | ldqa int8 |" in (out / "bench-runtime.md").read_text()


def test_prompt_ids_have_the_asked_length(small_tokenizer):
    for n in (64, 3000):
        ids = bench_runtime.prompt_ids(small_tokenizer, n)
        assert len(ids) == n and ids[0] == small_tokenizer.bos_id
        assert small_tokenizer.decode(ids[-12:]).strip().endswith("Answer:")


def test_compare_weights_pairs_examples_of_one_mode(tmp_path):
    from ldqa.eval.bench.compare_weights import compare

    head = "mode,example_id,prediction,score,ttft_ms,tokens_per_s\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "results.csv").write_text(head + "full,q1,x,1,10,5\nfull,q2,y,0,10,5\nfull,q3,z,1,10,5\n"
                                                "block,q1,x,0,1,5\n")
    (tmp_path / "b" / "results.csv").write_text(head + "full,q1,x,1,5,9\nfull,q2,w,1,5,9\nfull,q4,v,1,5,9\n"
                                                "block,q1,x,1,1,5\n")
    c = compare(tmp_path / "a", tmp_path / "b")
    assert c["n"] == 2 and c["identical_predictions"] == 1  # q1, q2 shared; q3, q4 are not
    assert c["diff_points"] == 50.0 and c["ref_score"] == 0.5 and c["score"] == 1.0
    with pytest.raises(ValueError, match="share 1 examples"):
        compare(tmp_path / "a", tmp_path / "b", "block")
    # a saved results.csv.gz reads as its directory does; a missing run names its path
    import gzip

    with gzip.open(tmp_path / "b.csv.gz", "wt") as f:
        f.write((tmp_path / "b" / "results.csv").read_text())
    assert compare(tmp_path / "a", tmp_path / "b.csv.gz") == {**c, "run": str(tmp_path / "b.csv.gz")}
    with pytest.raises(FileNotFoundError, match="nowhere"):
        compare(tmp_path / "a", tmp_path / "nowhere")
    # one run's block rows against its own full rows
    with pytest.raises(ValueError, match="share 1 examples"):  # only q1 has a block row
        compare(tmp_path / "a", tmp_path / "a", "block", ref_mode="full")
    (tmp_path / "a" / "results.csv").write_text(head + "full,q1,x,1,10,5\nfull,q2,y,0,10,5\n"
                                                "block,q1,x,0,1,5\nblock,q2,y,0,1,5\n")
    m = compare(tmp_path / "a", tmp_path / "a", "block", ref_mode="full")
    assert m["n"] == 2 and m["diff_points"] == -50.0 and m["identical_predictions"] == 2


def test_compare_weights_reports_f1_words_and_answers_at_the_cap(tmp_path):
    from ldqa.eval.bench.compare_weights import compare, main

    head = "mode,example_id,answers,prediction,score,ttft_ms,tokens_per_s,stop_reason\n"
    (tmp_path / "a.csv").write_text(head + "full,q1,18 Nm,The bolts take 18 Nm of torque says passage,1,10,5,max_new_tokens\n"
                                    "full,q2,E-14 | E14,no idea,0,10,5,eos\n")
    (tmp_path / "b.csv").write_text(head + "full,q1,18 Nm,18 Nm,1,5,9,eos\nfull,q2,E-14 | E14,E-14,1,5,9,eos\n")
    c = compare(tmp_path / "a.csv", tmp_path / "b.csv")
    assert c["f1"] == 1.0 and 0 < c["ref_f1"] < 0.5 and c["f1_diff_points"] > 50  # padding costs F1, not EM
    assert (c["ref_words"], c["words"]) == (5.5, 1.5) and (c["ref_at_cap"], c["at_cap"]) == (1, 0)
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    # a row without a TTFT (an abstained jsonl answer) is left out of the median, not an error
    (tmp_path / "c.csv").write_text(head + "full,q1,18 Nm,18 Nm,1,,,eos\nfull,q2,E-14 | E14,E-14,1,7,9,eos\n")
    assert compare(tmp_path / "a.csv", tmp_path / "c.csv")["ttft_ms"] == 7.0
    # answers kept as a Python list's text would read as one answer: refused, naming the run and the row
    (tmp_path / "d.csv").write_text(head + "full,q1,['18 Nm'],18 Nm,1,5,9,eos\nfull,q2,\"['E-14', 'E14']\",E-14,1,5,9,eos\n")
    with pytest.raises(ValueError, match=r"d\.csv: row q1 lists its answers"):
        compare(tmp_path / "a.csv", tmp_path / "d.csv")


def test_compare_weights_pairs_questions_across_gold_positions_and_joins_runs(tmp_path):
    from ldqa.eval.bench.compare_weights import compare, main

    head = "mode,example_id,gold_position,record,answers,prediction,score\n"
    row = lambda m, r, p, pred, s: f"{m},q{r}/pos{p},{p},{r},x,{pred},{s}\n"  # noqa: E731
    (tmp_path / "a.csv").write_text(head + row("full", 1, 1, "x", 1) + row("full", 1, 10, "y", 0)
                                    + row("block", 1, 1, "y", 0) + row("block", 1, 10, "x", 1))
    (tmp_path / "b.csv").write_text(head + row("full", 2, 1, "x", 1) + row("full", 2, 10, "x", 1)
                                    + row("block", 2, 1, "x", 1) + row("block", 2, 10, "y", 0))
    ab = f"{tmp_path / 'a.csv'},{tmp_path / 'b.csv'}"  # two runs of different questions, read as one
    # block's gold-first answers against full attention's gold-last ones, question by question
    c = compare(Path(ab), Path(ab), "block", "full", position=1, ref_position=10)
    assert c["n"] == 2 and (c["ref_score"], c["score"]) == (0.5, 0.5) and c["identical_predictions"] == 2
    assert compare(Path(ab), Path(ab), "block", "full", position=10, ref_position=1)["diff_points"] == -50.0
    assert compare(Path(ab), Path(ab), "block", "full", position=1)["diff_points"] == -50.0  # both at gold 1
    assert main(["--mode", "block", "--ref-mode", "full", "--position", "1", "--ref-position", "10", ab, ab]) == 0
    assert main(["--ref-position", "10", ab, ab]) == 2 and main(["--position", "first", ab, ab]) == 2
    with pytest.raises(ValueError, match="ref_position needs position"):
        compare(Path(ab), Path(ab), "block", "full", ref_position=10)
    # the same example in two joined files, and rows without gold positions, are refused by name
    with pytest.raises(ValueError, match=r"a\.csv and .*a2\.csv both hold full row q1/pos1"):
        (tmp_path / "a2.csv").write_text((tmp_path / "a.csv").read_text())
        compare(Path(f"{tmp_path / 'a.csv'},{tmp_path / 'a2.csv'}"), Path(ab))
    (tmp_path / "c.csv").write_text("mode,example_id,prediction,score\nfull,q1,x,1\nfull,q2,x,1\n")
    with pytest.raises(ValueError, match="--position needs nq-multidoc rows"):
        compare(tmp_path / "c.csv", tmp_path / "c.csv", position=1)


def test_kv_read_bytes_counts_a_sliding_layer_s_window_only():
    from types import SimpleNamespace

    cfg = SimpleNamespace(layer_types=["sliding", "sliding", "full"], sliding_window=512, num_layers=3,
                          num_kv_heads=2, head_dim=64)
    per_key = 2 * 2 * 64 * 4  # K and V, 2 heads of 64, fp32
    assert bench_runtime.kv_read_bytes(cfg, 100, 4) == 3 * 100 * per_key  # inside the window: every key
    assert bench_runtime.kv_read_bytes(cfg, 8192, 4) == (2 * 512 + 8192) * per_key
    assert bench_runtime.kv_read_bytes(cfg, 8192, 2) == (2 * 512 + 8192) * per_key // 2
    llama = SimpleNamespace(layer_types=[], sliding_window=None, num_layers=4, num_kv_heads=1, head_dim=8)
    assert bench_runtime.kv_read_bytes(llama, 10, 2) == 4 * 10 * 2 * 8 * 2


def test_bench_decode_matrices_times_every_matrix_kind(tiny_model_dir, tmp_path):
    from ldqa.eval.bench import bench_decode_matrices as bench

    assert bench.main(["--model", str(tiny_model_dir("qwen2")), "--weights", "q8_0", "--passes", "1",
                       "--decode-steps", "2", "--prompt-tokens", "16", "--out", str(tmp_path)]) == 0
    import json

    res = json.loads((tmp_path / "bench-decode-matrices.json").read_text())
    assert [r["matrix"] for r in res["rows"]] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj", "lm_head"]
    assert all(r["ms"] > 0 and r["bytes"] > 0 and r["count"] == (1 if r["matrix"] == "lm_head" else 3)
               for r in res["rows"])
    assert res["decode_step_ms"] > 0


def test_clustered_standard_error_by_question():
    """One observation per cluster: the usual stdev / sqrt(n); answers of one question moving together
    widen it; worked by hand for two clusters of two."""
    import statistics

    from ldqa.eval.bench.compare_weights import clustered_se

    d = [1.0, 0.0, -1.0, 0.0, 1.0]
    assert clustered_se(d, list("abcde")) == pytest.approx(statistics.stdev(d) / len(d) ** 0.5)
    # mean 0.5; cluster sums of (d - mean): a: 0.5 + 0.5 = 1, b: -0.5 - 0.5 = -1 -> sqrt(2 / 1 * 2) / 4
    assert clustered_se([1.0, 1.0, 0.0, 0.0], list("aabb")) == pytest.approx(0.5)
    assert clustered_se([1.0, 1.0, 0.0, 0.0], list("abab")) < 0.5  # the same values, mixed across clusters
    with pytest.raises(ValueError, match="2 clusters"):
        clustered_se([1.0, 0.0], ["a", "a"])
    with pytest.raises(ValueError, match="3 values for 2 cluster labels"):
        clustered_se([1.0, 0.0, 1.0], ["a", "b"])


def test_compare_weights_pools_gold_positions_with_a_standard_error_by_question(tmp_path):
    """Rows of several gold positions per question: the SE also clustered by question, and the answers at
    the cap also counted as questions; one row per question gives no such columns."""
    from ldqa.eval.bench.compare_weights import compare, main

    head = "mode,example_id,gold_position,record,answers,prediction,score,stop_reason\n"
    row = lambda m, r, p, s, stop="eos": f"{m},q{r}/pos{p},{p},{r},x,p{s},{s},{stop}\n"  # noqa: E731
    text = head
    for r, (f, b) in enumerate([(1, 0), (1, 1), (0, 0), (1, 1)]):  # question 0: block loses at both positions
        for p in (1, 10):
            text += row("full", r, p, f) + row("block", r, p, b, "max_new_tokens" if r == 0 else "eos")
    (tmp_path / "a.csv").write_text(text)
    c = compare(tmp_path / "a.csv", tmp_path / "a.csv", "block", "full")
    assert c["n"] == 8 and c["questions"] == 4 and c["diff_points"] == -25.0
    assert c["se_points_by_question"] > c["se_points"]  # question 0's two losses move together
    assert (c["at_cap"], c["questions_at_cap"], c["ref_questions_at_cap"]) == (2, 1, 0)
    one = compare(tmp_path / "a.csv", tmp_path / "a.csv", "block", "full", position=1)
    assert one["se_points_by_question"] is None and one["questions_at_cap"] is None
    assert main(["--mode", "block", "--ref-mode", "full", str(tmp_path / "a.csv"), str(tmp_path / "a.csv")]) == 0
