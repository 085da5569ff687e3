"""`ldqa eval jsonl --retriever R --top-k K`: each record's context indexed as its own collection and
answered as `LongDocQA.ask` would (ldqa.eval.answering.answer_from_collection), with a random-weight Gemma 3
(answers are noise; what is checked is where the passages come from, how many, the gold-in-retrieved
measure, the cache keys, resuming and the errors)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ldqa.app.cli import main
from ldqa.eval import answering, harness
from ldqa.eval.harness import EvalConfig, Mode, mode_cache_key, parse_modes, settings_hash
from ldqa.eval.metrics import answer_in_passages


def _context(topic: str, n: int, gold: str | None) -> str:
    """n short paragraphs about `topic`, `gold` (a sentence) in the middle: several 256-token chunks."""
    paras = [f"Note {i} on the {topic}: the {topic} log for day {i} records a routine inspection of shelf "
             f"{i % 7}, a temperature of {600 + i} degrees and a cooling time of {i + 3} hours." for i in range(n)]
    if gold:
        paras.insert(n // 2, gold)
    return "\n\n".join(paras)


A_GOLD = "The secret glaze ingredient of the Korvel kiln is smoked paprika."
RECORDS = [
    {"_id": "kiln", "input": "What is the secret glaze ingredient of the Korvel kiln?", "answers": ["smoked paprika"],
     "context": _context("Korvel kiln", 60, A_GOLD)},
    {"_id": "boat", "input": "What colour is the hull of the Lindqvist boat?", "answers": ["ultramarine"],
     "context": _context("Lindqvist boat", 60, "The hull of the Lindqvist boat was repainted last spring.")},
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("collections") / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def _run(data, out, model, *extra) -> dict:
    argv = ["eval", "jsonl", "--data", str(data), "--out", str(out), "--model", str(model), "--limit", "2",
            "--max-new-tokens", "3", "--no-progress", *map(str, extra)]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def _spans(row) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.split(":")) for s in row["retrieved"]]


def test_answer_in_passages_by_hand():
    # normalized (SQuAD) containment of whole tokens in one passage
    assert answer_in_passages(["they got press hits in over 60 different publications"], ["over 60"]) == 1.0
    assert answer_in_passages(["the Internet worm of 1960"], ["60"]) == 0.0  # "60" is not a token of "1960"
    assert answer_in_passages(["And bingo, there it is: the Mens Wearhouse."], ["The Men's Wearhouse"]) == 1.0
    assert answer_in_passages(["a", "It cost $2800, so"], ["$2,800", "$2800"]) == 1.0  # any gold, any passage
    # an answer split across two passages is not counted; no passages, nothing found
    assert answer_in_passages(["... smoked", "paprika ..."], ["smoked paprika"]) == 0.0
    assert answer_in_passages([], ["x"]) == 0.0
    with pytest.raises(ValueError, match="answers is empty"):
        answer_in_passages(["x"], [])


def test_modes_and_cache_keys(data):
    # jsonl: no --retriever = the whole context (no collection); a retriever = per-record collections
    assert parse_modes("full", retriever=None, benchmark="jsonl") == [Mode("full")]
    ms = parse_modes("full,block@dense", retriever="hybrid,bm25", benchmark="jsonl")
    assert [m.label for m in ms] == ["full@hybrid", "full@bm25", "block@dense"] and all(m.collection for m in ms)
    # the retrieval benchmark keeps hybrid as its default retriever and has no per-record collections
    assert parse_modes("full", retriever=None, benchmark="retrieval") == [Mode("full", "none", "hybrid")]
    # other benchmarks ignore the retriever
    assert parse_modes("full", retriever="bm25", benchmark="niah") == [Mode("full")]
    keys = {mode_cache_key(m) for m in [Mode("full"), *ms, Mode("full", "none", "hybrid")]}
    assert len(keys) == 5  # whole, each retriever, and the retrieval benchmark's full@hybrid all apart
    assert mode_cache_key(ms[0]).startswith("full/none@hybrid+collection#")
    # --top-k is in the settings hash (so are data, model, seed, ...)
    cfg = EvalConfig("jsonl", str(data), retriever="hybrid")
    assert settings_hash(cfg, "fp", 8) != settings_hash(EvalConfig("jsonl", str(data), retriever="hybrid", top_k=3),
                                                        "fp", 8)
    # the collection directory: keyed by the context's hash and the settings; same context -> same dir
    d1 = answering.collection_dir(Path("/c"), "ab" * 32, "m")
    assert d1 == answering.collection_dir(Path("/c"), "ab" * 32, "m") != answering.collection_dir(Path("/c"), "cd" * 32, "m")
    assert d1 != answering.collection_dir(Path("/c"), "ab" * 32, "another-tokenizer")
    assert d1.name.startswith("ab" * 8 + "-")


@pytest.mark.parametrize("extra, match", [
    (["--retriever", "foo"], "--retriever: unknown retriever 'foo'"),
    (["--chunk-tokens", "128"], "--chunk-tokens applies to jsonl answered over per-record collections"),
    (["--abstain-below", "0"], "--abstain-below applies to jsonl answered over per-record collections"),
    (["--retriever", "bm25", "--chunk-tokens", "64", "--overlap-tokens", "64"], "need chunk tokens >= 1 and 0 <= overlap"),
    (["--retriever", "bm25", "--abstain-below", "2"], "--abstain-below 2.0: a cosine similarity"),
    (["--retriever", "bm25", "--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["--retriever", "bm25", "--modes", "full,hf"], "--modes hf: the transformers reference"),
])
def test_bad_retriever_arguments(data, tmp_path, capsys, extra, match):
    assert main(["eval", "jsonl", "--data", str(data), "--out", str(tmp_path / "o"), *extra]) == 2
    assert match in capsys.readouterr().err


def test_retriever_needs_a_context(tmp_path, tiny_model_dir):
    path = tmp_path / "passages.jsonl"
    path.write_text(json.dumps({"question": "Who?", "answers": ["Ada"], "passages": ["Ada wrote it."]}) + "\n")
    with pytest.raises(ValueError, match=r"record 1: --retriever indexes each record's context"):
        harness.run(EvalConfig("jsonl", str(path), out=str(tmp_path / "o"), retriever="bm25",
                               model=str(tiny_model_dir("gemma3")), progress=False))


def test_jsonl_over_per_record_collections(tmp_path, tiny_model_dir, data):
    model = tiny_model_dir("gemma3")
    out = tmp_path / "ret"
    res = _run(data, out, model, "--retriever", "bm25", "--top-k", "2", "--modes", "full,block")
    assert [m["mode"] for m in res["modes"]] == ["full@bm25", "block@bm25"]
    rows = {(r["example_id"], r["mode"]): r for r in res["rows"]}
    assert len(rows) == 4 and res["computed"] == 4
    for (ex, mode), r in rows.items():
        rec = next(x for x in RECORDS if x["_id"] == ex)
        other = next(x for x in RECORDS if x["_id"] != ex)
        assert r["context_sha256"] == hashlib.sha256(rec["context"].encode()).hexdigest()
        assert r["collection_chunks"] > 2 and r["n_passages"] == 2  # top-k honoured (more chunks exist)
        for a, b in _spans(r):  # each chunk is a piece of the record's own context, not the other one's
            piece = rec["context"][a:b]
            assert len(piece) > 100 and piece in rec["context"] and piece not in other["context"]
        assert r["retrieval_ms"] > 0 and r["ttft_cold_ms"] == r["ttft_ms"] > 0 and r["ttft_warm_ms"] > 0
        assert r["abstained"] is False and r["prompt_tokens"] > 0
        # gold in retrieved, by hand: the kiln's gold sentence shares the question's words (BM25 finds it);
        # the boat's answer occurs nowhere in its context
        want = 1.0 if ex == "kiln" else 0.0
        assert r["gold_in_retrieved"] == want
        assert any(A_GOLD in rec["context"][a:b] for a, b in _spans(r)) == (ex == "kiln")
    # warm: block mode reads the passages' KV blocks stored by the first (cold) ask; full attention has none
    for ex in ("kiln", "boat"):
        b, f = rows[(ex, "block@bm25")], rows[(ex, "full@bm25")]
        assert b["tokens_reused_warm"] > b["tokens_reused"] == 0 and f["tokens_reused_warm"] == f["tokens_reused"] == 0
        assert b["index_cached"] or f["index_cached"]  # the second mode over a record found its collection
    assert len(list((out / "collections").iterdir())) == 2  # one collection per distinct context
    summary = (out / "summary.md").read_text()
    assert "gold_in_retrieved" in summary and "ttft_warm_ms" in summary
    assert [m["gold_in_retrieved"] for m in res["modes"]] == [0.5, 0.5]

    # rerun: every answer from the cache; another --top-k is another setting (recomputed) over the same
    # collections (nothing embedded again)
    again = _run(data, out, model, "--retriever", "bm25", "--top-k", "2", "--modes", "full,block")
    assert again["computed"] == 0 and again["cached"] == 4 and again["rows"] == res["rows"]
    k1 = _run(data, out, model, "--retriever", "bm25", "--top-k", "1", "--modes", "block")
    assert k1["computed"] == 2 and all(r["n_passages"] == 1 and r["index_cached"] for r in k1["rows"])
    # cold means cold: the top chunk's KV block, stored on disk by the first run, was dropped before the ask
    assert all(r["tokens_reused"] == 0 < r["tokens_reused_warm"] for r in k1["rows"])
    # the whole-context path stays the default: no collection, the context split into passages
    whole = _run(data, tmp_path / "whole", model, "--passage-tokens", "128")
    assert [m["mode"] for m in whole["modes"]] == ["full"]
    assert all("gold_in_retrieved" not in r and r["n_passages"] > 2 for r in whole["rows"])
    assert not (tmp_path / "whole" / "collections").exists()


def test_resume_after_interruption(tmp_path, tiny_model_dir, data, monkeypatch):
    model = tiny_model_dir("gemma3")
    from ldqa.app.api import LongDocQA

    real, calls = LongDocQA.ask, []

    def counting(self, question, **kw):
        calls.append(question)
        if len(calls) == 3:  # the second record's first ask
            raise KeyboardInterrupt
        return real(self, question, **kw)

    monkeypatch.setattr(LongDocQA, "ask", counting)
    out = tmp_path / "int"
    with pytest.raises(KeyboardInterrupt):
        _run(data, out, model, "--retriever", "bm25", "--top-k", "2")
    calls.clear()
    res = _run(data, out, model, "--retriever", "bm25", "--top-k", "2")
    assert res["cached"] == 1 and res["computed"] == 1 and len(calls) == 2  # cold + warm ask of the second
    order = [RECORDS[i]["_id"] for i in harness._sample(2, EvalConfig("jsonl", str(data), limit=2))]
    assert [r["example_id"] for r in res["rows"]] == order


def test_chunking_and_abstention_options(tmp_path, tiny_model_dir, data):
    """--chunk-tokens/--overlap-tokens build other collections (their own directories and cache keys, more
    chunks when smaller); --abstain-below reaches `ask` (1.0: every question refused without the model, 0:
    never); the defaults keep the keys they had."""
    cfg = EvalConfig("jsonl", str(data), retriever="bm25")
    assert answering.collection_settings(cfg) == answering.collection_settings()
    small = EvalConfig("jsonl", str(data), retriever="bm25", chunk_tokens=96, overlap_tokens=16)
    assert answering.collection_settings(small)["chunk_tokens"] == 96
    m = Mode("full", "none", "bm25", collection=True)
    assert mode_cache_key(m, cfg=cfg) == mode_cache_key(m) != mode_cache_key(m, cfg=small)
    assert answering.collection_dir(Path("/c"), "ab" * 32, "m", small) != answering.collection_dir(Path("/c"), "ab" * 32, "m")
    model = tiny_model_dir("gemma3")
    out = tmp_path / "o"
    base = _run(data, out, model, "--retriever", "bm25", "--top-k", "1", "--abstain-below", "0")
    chunked = _run(data, out, model, "--retriever", "bm25", "--top-k", "1", "--abstain-below", "0",
                   "--chunk-tokens", "96", "--overlap-tokens", "16")
    assert chunked["computed"] == 2  # another setting: answered anew, over other collections
    for a, b in zip(base["rows"], chunked["rows"]):
        assert b["collection_chunks"] > a["collection_chunks"] and not a["abstained"] and not b["abstained"]
        (x, y), = _spans(b)
        assert y - x < max(q - p for p, q in _spans(a))  # a smaller chunk
    assert len(list((out / "collections").iterdir())) == 4
    # (bm25 passages carry no dense score, so `ask` abstains only with a dense or hybrid retriever)
    refused = _run(data, out, model, "--retriever", "hybrid", "--top-k", "1", "--abstain-below", "1")
    assert refused["computed"] == 2 and all(r["abstained"] and r["ttft_ms"] is None for r in refused["rows"])


def test_collection_lock_serializes_answers_over_one_record(tmp_path):
    """Two answers over one record's collection (e.g. two Ray workers, two modes) take turns: the second
    waits while the first holds the lock (flock: per open file, so two threads contend as processes do)."""
    import threading
    import time

    events = []

    def answer(name, hold):
        with answering.collection_lock(tmp_path):
            events.append(("start", name))
            time.sleep(hold)
            events.append(("end", name))

    a = threading.Thread(target=answer, args=("a", 0.5))
    a.start()
    time.sleep(0.1)
    b = threading.Thread(target=answer, args=("b", 0.0))
    b.start()
    a.join()
    b.join()
    assert events == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b")]
    with answering.collection_lock(tmp_path / "other"):  # another record: its own lock, free
        with answering.collection_lock(tmp_path / "third"):
            pass
