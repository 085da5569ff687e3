"""The Python API end to end on the bundled sample, with a tiny random-weight Gemma 3 (fast) and, marked
slow, the real Gemma 3 270M."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ldqa.app.api import LongDocQA
from ldqa.retrieval.retriever import EmptyCollectionError

SAMPLE = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"


@pytest.fixture
def tiny_qa(tmp_path, tiny_model_dir):
    return LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), max_new_tokens=8)


def _copy_sample(dst: Path) -> Path:
    shutil.copytree(SAMPLE, dst)
    return dst


def test_ingest_dedup_and_replace(tiny_qa, tmp_path):
    docs = _copy_sample(tmp_path / "docs")
    r1 = tiny_qa.ingest([docs])
    assert [f.status for f in r1.files] == ["added"] * 4, r1.files
    assert all(f.ms > 0 for f in r1.files) and sum(f.ms for f in r1.files) <= r1.ms  # each file's own time
    n_chunks = tiny_qa.store.n_chunks()
    assert n_chunks == r1.chunks > 4
    r2 = tiny_qa.ingest([docs])
    assert [f.status for f in r2.files] == ["skipped"] * 4
    assert tiny_qa.store.n_chunks() == n_chunks
    log = docs / "maintenance_log.txt"
    old = tiny_qa.store.get_document_by_path(str(log.resolve()))
    log.write_text("Kiln SL30-9999 was repainted blue on 2 May 2025.\n", encoding="utf-8")
    r3 = tiny_qa.ingest([log])
    assert r3.files[0].status == "replaced" and r3.files[0].chunks == 1
    assert tiny_qa.store.n_documents() == 4
    assert tiny_qa.store.n_chunks() == n_chunks - old["n_chunks"] + 1
    hits = tiny_qa.retrieve("repainted blue", top_k=1, retriever="bm25")
    assert "repainted blue" in hits[0].text


def test_ask_returns_cited_answer_with_timings(tiny_qa):
    tiny_qa.ingest([SAMPLE])
    stream = tiny_qa.stream("How much does the SL-30 Pro model cost?", top_k=3)
    pieces = list(stream)
    ans = stream.answer
    assert "".join(pieces).strip() == ans.text
    assert len(ans.passages) == 3
    assert {"retrieval_ms", "ttft_ms", "tokens_per_s", "prompt_tokens", "generated_tokens"} <= ans.timings.keys()
    assert ans.timings["prompt_tokens"] > 100 and ans.timings["generated_tokens"] >= 1
    assert ans.settings["top_k"] == 3
    d = ans.to_dict()
    assert d["passages"][0]["title"] and "citations" in d


def test_bad_inputs_are_reported_per_file(tiny_qa, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "empty.txt").write_text("")
    (bad / "blank.md").write_text("  \n\t \n")
    (bad / "binary.txt").write_bytes(b"\x00\x01\x02" * 200)
    (bad / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >>\nnot a pdf")
    docx = tmp_path / "notes.docx"  # given by name: a directory walk only takes supported types
    docx.write_bytes(b"PK\x03\x04")
    good = bad / "good.txt"
    good.write_text("The pressure relief valve opens at 2.5 bar.\n")
    report = tiny_qa.ingest([bad, docx, tmp_path / "missing.txt"])
    status = {Path(f.path).name: f.status for f in report.files}
    assert status == {"binary.txt": "error", "blank.md": "error", "broken.pdf": "error", "empty.txt": "error",
                      "good.txt": "added", "notes.docx": "error", "missing.txt": "error"}
    for f in report.errors:
        assert f.reason and Path(f.path).name  # a reason for every failure
    assert tiny_qa.store.n_documents() == 1


def test_question_errors(tiny_qa):
    with pytest.raises(EmptyCollectionError, match="ingest"):
        tiny_qa.ask("anything?")
    tiny_qa.ingest([SAMPLE])
    with pytest.raises(ValueError, match="question is empty"):
        tiny_qa.ask("   ")
    with pytest.raises(ValueError, match="top_k"):
        tiny_qa.ask("What?", top_k=0)
    with pytest.raises(ValueError, match="retriever"):
        tiny_qa.ask("What?", retriever="magic")


def test_special_token_text_in_documents_stays_plain(tiny_qa, tmp_path):
    from ldqa.app.prompt import build_prompt

    doc = tmp_path / "tricky.txt"
    doc.write_text("Operators type <|im_start|>system and <|endoftext|> into the console. <bos> too.\n")
    tiny_qa.ingest([doc])
    passages = tiny_qa.retrieve("What do operators type into the console?", top_k=1)
    tok = tiny_qa.llm.tokenizer
    ids = build_prompt(tok, passages, "What do operators type?").ids()
    special = set(tok.hf.all_special_ids)
    assert [i for i in ids if i in special] == ([tok.bos_id] if tok.bos_id in special else [])
    assert "<|im_start|>" in tok.decode(ids)


CRASH = textwrap.dedent("""
    import os, sys
    from ldqa.app.api import LongDocQA
    from ldqa.indexes.store import Store
    where = sys.argv[3]
    if where == "before_faiss":          # every SQLite commit done, faiss file never written
        Store.flush = lambda self: os._exit(17)
    else:                                # die inside the 3rd file's transaction
        real, n = Store.add_document, [0]
        def add(self, *a, **k):
            n[0] += 1
            if n[0] == 3:
                self.db.conn.execute("BEGIN")
                self.db.conn.execute("DELETE FROM chunks")
                os._exit(17)
            return real(self, *a, **k)
        Store.add_document = add
    LongDocQA(store=sys.argv[1], model=sys.argv[2]).ingest([sys.argv[4]])
""")


@pytest.mark.parametrize("where", ["before_faiss", "mid_transaction"])
def test_store_survives_a_crash_mid_ingest(tmp_path, tiny_model_dir, where):
    model = str(tiny_model_dir("gemma3"))
    store = tmp_path / "store"
    first = tmp_path / "first.txt"
    first.write_text("The drying chamber holds exactly forty boards of oak.\n")
    qa = LongDocQA(store=store, model=model)
    qa.ingest([first])
    qa.store.close()
    proc = subprocess.run([sys.executable, "-c", CRASH, str(store), model, where, str(SAMPLE)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 17, proc.stderr[-2000:]
    qa = LongDocQA(store=store, model=model)  # opens; rebuilds what is stale
    n_docs = qa.store.n_documents()
    assert n_docs == (5 if where == "before_faiss" else 3)  # committed files are kept, the torn one is not
    dense = qa.retrieve("How many boards does the drying chamber hold?", top_k=n_docs * 3, retriever="dense")
    assert {p.doc_id for p in dense} == {d["id"] for d in qa.documents()}
    assert "forty boards" in qa.retrieve("forty boards of oak", top_k=1, retriever="bm25")[0].text
    report = qa.ingest([SAMPLE])  # the rest comes in on the next run
    assert qa.store.n_documents() == 5 and not report.errors


@pytest.mark.slow
def test_real_gemma_answers_a_sample_question(tmp_path):
    qa = LongDocQA(store=tmp_path / "store", model="gemma3-270m")
    qa.ingest([SAMPLE])
    ans = qa.ask("According to service bulletin SB-2024-07, to what torque must each fan hub bolt be tightened?",
                 top_k=5)
    assert "18 Nm" in ans.text
    assert any(c.path.endswith("service_bulletin.pdf") and c.page == 2 for c in ans.citations)


def test_block_modes_reuse_stored_kv_and_match_full_at_ratio_one(tiny_qa, tmp_path):
    """Block reuse itself, without debiasing (debias="none"; the defaults debias every mode)."""
    docs = _copy_sample(tmp_path / "docs")
    tiny_qa.ingest([docs])
    q = "According to service bulletin SB-2024-07, what torque for each fan hub bolt?"
    full = tiny_qa.ask(q, top_k=3, debias="none")
    assert full.timings["tokens_reused"] == 0
    cold = tiny_qa.ask(q, top_k=3, debias="none", attention="block")
    assert cold.timings["kv_misses"] == 3 and cold.timings["kv_hits"] == 0
    warm = tiny_qa.ask(q, top_k=3, debias="none", attention="block")
    assert warm.timings["kv_hits"] == 3 and warm.timings["tokens_reused"] > 100
    assert warm.text == cold.text  # the stored blocks (fp16) give the same greedy answer here
    assert warm.settings["block_headers"] == "cached" and warm.timings["header_tokens_reused"] > 0
    assert warm.timings["tokens_computed"] < warm.timings["prompt_tokens"] - warm.timings["tokens_reused"]
    fresh = tiny_qa.ask(q, top_k=3, debias="none", attention="block", block_headers="fresh")
    assert fresh.settings["block_headers"] == "fresh" and fresh.timings["header_tokens_reused"] == 0
    assert fresh.timings["tokens_computed"] == warm.timings["tokens_computed"] + warm.timings["header_tokens_reused"]
    with pytest.raises(ValueError, match="block_headers"):
        tiny_qa.ask(q, top_k=3, debias="none", attention="block", block_headers="sometimes")
    exact = tiny_qa.ask(q, top_k=3, debias="none", attention="block+recompute", recompute_ratio=1.0)
    assert exact.text == full.text and exact.timings["tokens_reused"] == 0


def test_precompute_kv_fills_the_store_and_replacement_drops_blocks(tiny_qa, tmp_path):
    docs = _copy_sample(tmp_path / "docs")
    report = tiny_qa.ingest([docs])
    kv = tiny_qa.precompute_kv([f.doc_id for f in report.files])
    assert kv["blocks"] == tiny_qa.store.n_chunks() == kv["computed"]
    assert tiny_qa.kv_store.stats.entries_on_disk == kv["blocks"]
    # the tokens encoded and the bytes they take in the store (its own count of the tensor payload)
    assert kv["tokens"] >= sum(r["n_tokens"] for r in tiny_qa.store.get_chunks(tiny_qa.store.chunk_ids()))
    assert kv["bytes"] == tiny_qa.kv_store.stats.bytes_on_disk > 0
    ans = tiny_qa.ask("What is the maximum load of the chamber?", top_k=2, attention="block", debias="none")
    assert ans.timings["kv_hits"] == 2 and ans.timings["kv_misses"] == 0
    # block modes whose default anchor passages differ read blocks of their own: precomputed per mode
    from ldqa.attention.block_attention import DEFAULT_ANCHOR_PASSAGES

    if DEFAULT_ANCHOR_PASSAGES["block"] != DEFAULT_ANCHOR_PASSAGES["block+recompute"]:
        cold = tiny_qa.ask("What is the maximum load of the chamber?", top_k=2, attention="block+recompute",
                           debias="none", recompute_ratio=0.0)
        assert cold.timings["kv_misses"] > 0
        again = tiny_qa.precompute_kv(attention="block+recompute")
        assert again["computed"] == again["blocks"] - cold.timings["kv_misses"]
        warm = tiny_qa.ask("What is the maximum load of the chamber?", top_k=2, attention="block+recompute",
                           debias="none", recompute_ratio=0.0)
        assert warm.timings["kv_hits"] == 2 and warm.timings["kv_misses"] == 0
        # debiased, the final context is rebuilt after block mode's measurements: a question over passages
        # not stored yet (one anchor passage: blocks of their own) reports nothing reused from the store, a
        # warm one what it reused
        q = "What is the moisture target?"
        cold = tiny_qa.ask(q, top_k=2, attention="block+recompute", debias="calibrate+reorder", anchor_passages=1)
        warm = tiny_qa.ask(q, top_k=2, attention="block+recompute", debias="calibrate+reorder", anchor_passages=1)
        assert cold.timings["kv_misses"] > 0 and cold.timings["tokens_reused"] == 0
        assert warm.timings["kv_misses"] == 0 and 0 < warm.timings["tokens_reused"] < warm.timings["prompt_tokens"]
        assert tiny_qa.precompute_kv(attention="block")["computed"] == 0  # block's blocks are still there
    for bad in ("full", "retrieval", "blocks"):
        with pytest.raises(ValueError, match="precomputed for a block mode"):
            tiny_qa.precompute_kv(attention=bad)
    n_blocks = tiny_qa.kv_store.stats.entries_on_disk
    log = docs / "maintenance_log.txt"
    n_old = tiny_qa.store.get_document_by_path(str(log.resolve()))["n_chunks"]
    log.write_text("Fresh content about kiln paint colours only.\n", encoding="utf-8")
    tiny_qa.ingest([log])  # its chunks go, and with them their KV blocks; the others stay
    assert tiny_qa.kv_store.stats.entries_on_disk == n_blocks - n_old * (n_blocks // kv["blocks"])


def test_same_bytes_twice_in_one_batch_is_stored_once(tiny_qa, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    for p in (a, b):
        p.write_text("Identical passage about kiln humidity control.\n")
    report = tiny_qa.ingest([a, b])
    assert [f.status for f in report.files] == ["added", "skipped"]
    assert report.files[1].doc_id == report.files[0].doc_id
    assert tiny_qa.store.n_documents() == 1


def test_retrieval_attention_mode_matches_full_with_all_keys_and_reports_keys_touched(tiny_qa, tmp_path):
    tiny_qa.ingest([_copy_sample(tmp_path / "docs")])
    q = "According to service bulletin SB-2024-07, what torque for each fan hub bolt?"
    full = tiny_qa.ask(q, top_k=4, debias="none")  # retrieval attention is never debiased
    every = tiny_qa.ask(q, top_k=4, attention="retrieval", top_k_keys="all", window=16, min_indexed=16)
    assert every.text == full.text and every.timings["retrieval_steps"] > 0
    some = tiny_qa.ask(q, top_k=4, attention="retrieval", top_k_keys=32, window=16, sink=4, min_indexed=16,
                       index="keys", scan_fraction=0.1)
    t = some.timings
    assert t["index_builds"] >= 1 and t["index_build_ms"] > 0
    steps = t["retrieval_steps"]  # one global layer: one per decode step; the recent zone grows by one a step
    assert steps == t["generated_tokens"] - 1 and steps < 16
    assert t["keys_attended_per_step"] == 4 + 32 + 16 + (steps - 1) / 2
    assert 0 < t["keys_touched_fraction"] < 0.3  # 64 centroids + ~10% of the keys + the static zones
    assert some.settings["retrieval"]["top_k_keys"] == 32
    json.dumps(some.to_dict())  # settings stay JSON-serializable
    with pytest.raises(ValueError, match="only apply"):
        tiny_qa.ask(q, attention="full", top_k_keys=8)
    with pytest.raises(ValueError, match="unknown retrieval setting"):
        tiny_qa.ask(q, attention="retrieval", topk=8)
    with pytest.raises(ValueError, match="window"):
        tiny_qa.ask(q, attention="retrieval", window=0)


def test_instruction_and_answer_prefix_shape_the_prompt(tiny_qa, tmp_path):
    from ldqa.app.api import Passage
    from ldqa.app.prompt import INSTRUCTION, build_prompt

    tok = tiny_qa.llm.tokenizer
    ps = [Passage("JSON data", '{"a1": "v-17", "b2": "v-99"}'), Passage("Notes", "Nothing about keys here.")]
    default = build_prompt(tok, ps, "What is a1?")
    assert default.prefix == [tok.bos_id] + tok.encode(INSTRUCTION)
    assert build_prompt(tok, ps, "What is a1?", None, "").ids() == default.ids()
    instr = "Extract the value of the key.\n\n"
    seg = build_prompt(tok, ps, "What is a1?", instr, 'The value is "')
    assert seg.prefix == [tok.bos_id] + tok.encode(instr)
    assert seg.passages == default.passages and seg.headers == default.headers  # only prefix and question change
    assert tok.decode(seg.question).endswith('Question: What is a1?\nAnswer: The value is "')

    plain = tiny_qa.answer("What is a1?", ps, attention="block")
    assert plain.timings["kv_misses"] == 2 and "answer_prefix" not in plain.settings
    ans = tiny_qa.answer("What is a1?", ps, attention="block", instruction=instr, answer_prefix='The value is "')
    assert ans.settings["instruction"] == instr and ans.settings["answer_prefix"] == 'The value is "'
    assert ans.timings["prompt_tokens"] == len(seg)
    # a passage's stored KV depends on the prefix it was encoded after: a new instruction reuses none
    assert ans.timings["kv_misses"] == 2 and ans.timings["kv_hits"] == 0
    again = tiny_qa.answer("What is a1?", ps, attention="block", instruction=instr, answer_prefix='The value is "')
    assert again.timings["kv_hits"] == 2
    full = tiny_qa.answer("What is a1?", ps, instruction=instr, answer_prefix='The value is "')
    assert full.timings["prompt_tokens"] == len(seg)
    for bad in (dict(instruction=" "), dict(instruction=3), dict(answer_prefix=None)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tiny_qa.answer("What is a1?", ps, **bad)
    with pytest.raises(ValueError, match="answer_prefix"):
        tiny_qa.ask("What is a1?", answer_prefix=7)


def test_the_prompt_budget_is_checked_before_the_relevance_check(tiny_qa, monkeypatch):
    from ldqa.app.prompt import PromptTooLongError, build_prompt

    tiny_qa.ingest([SAMPLE])
    assert tiny_qa.ask("Why?", abstain_below=1.0).settings["abstained"]  # 1.0: every question that fits abstains
    searched = []
    search = tiny_qa.retriever.search
    monkeypatch.setattr(tiny_qa.retriever, "search", lambda *a, **k: searched.append(a) or search(*a, **k))
    over = "Which zebra crossed the savanna at noon? " * (tiny_qa.context_length // 4)
    with pytest.raises(PromptTooLongError, match="the question .* over the model's context window of 4096 tokens"):
        tiny_qa.ask(over, abstain_below=1.0)
    assert searched == []  # refused before retrieval
    # a question that fits alone but leaves no room for the best passage: refused, not "Not found"
    alone = len(build_prompt(tiny_qa.llm.tokenizer, [], "Why?").ids())
    monkeypatch.setattr(tiny_qa.llm.model.cfg, "max_position_embeddings", alone + 8 + 4)  # 8: the answer budget
    with pytest.raises(PromptTooLongError, match="no room for a passage"):
        tiny_qa.ask("Why?", abstain_below=1.0)
    assert len(searched) == 1


def test_block_anchors_encode_a_long_document_s_later_chunks_after_its_first(tiny_qa, tmp_path):
    doc = tmp_path / "long.md"
    doc.write_text("# Kiln handbook\n\n" + "\n\n".join(
        f"Section {i}. The SL-30 kiln setting number {i} is {i * 7} degrees for batch {i}." for i in range(1, 80)),
        encoding="utf-8")
    tiny_qa.ingest([doc])
    hits = tiny_qa.retrieve("What is setting number 61?", top_k=4)
    rows = {r["id"]: r for r in tiny_qa.store.get_chunks([h.chunk_id for h in hits])}
    first = tiny_qa.store.get_chunks(tiny_qa.store.chunk_ids()[:1])[0]
    anchored = tiny_qa._anchored(hits)
    assert any(rows[p.chunk_id]["ordinal"] > 0 for p in anchored)
    for p in anchored:
        assert p.anchor == (None if rows[p.chunk_id]["ordinal"] == 0 else first["text"])
    q = "What is setting number 61?"
    on = tiny_qa.ask(q, top_k=4, attention="block", debias="none", block_anchors=True)
    off = tiny_qa.ask(q, top_k=4, attention="block", debias="none")
    assert on.settings["block_anchors"] is True and off.settings["block_anchors"] is False
    n_anchored = sum(p.anchor is not None for p in anchored)
    assert on.timings["kv_misses"] == 4 and off.timings["kv_misses"] == n_anchored  # anchored blocks: other keys
    again = tiny_qa.ask(q, top_k=4, attention="block", debias="none", block_anchors=True)
    assert again.timings["kv_hits"] == 4 and again.text == on.text
    assert "block_anchors" not in tiny_qa.ask(q, top_k=4, debias="none").settings  # full attention
    with pytest.raises(ValueError, match="block_anchors"):
        tiny_qa.ask(q, attention="block", block_anchors="yes")


def test_anchor_passages_encode_every_block_after_them_under_keys_of_their_own(tiny_qa, tmp_path):
    import torch

    from ldqa.app.prompt import anchor_ids, build_prompt
    from ldqa.attention.block_attention import DEFAULT_ANCHOR_PASSAGES

    tiny_qa.ingest([_copy_sample(tmp_path / "docs")])
    q = "What torque for the fan hub bolts?"
    off = tiny_qa.ask(q, top_k=3, attention="block", debias="none", anchor_passages=0)
    on = tiny_qa.ask(q, top_k=3, attention="block", debias="none", anchor_passages=2)
    assert off.settings["anchor_passages"] == 0 and on.settings["anchor_passages"] == 2
    assert on.timings["kv_misses"] == 3  # the same passages' blocks under other keys
    again = tiny_qa.ask(q, top_k=3, attention="block", debias="none", anchor_passages=2)
    assert again.timings["kv_hits"] == 3 and again.text == on.text
    # the block read is the body encoded after prefix + anchor ids, moved to its slot (the runtime's own test)
    rt, chat = tiny_qa.block_runtime, tiny_qa.chat_format()
    seg = build_prompt(tiny_qa.llm.tokenizer, on.passages[:1], q, chat=chat)
    ids = anchor_ids(tiny_qa.llm.tokenizer, 2, None, chat)
    k, _ = rt.encode_block(seg.prefix, seg.passages[0], ids)
    k0, _ = rt.encode_block(seg.prefix, seg.passages[0])
    assert not torch.allclose(k, k0)  # the anchor changes what the block saw
    assert "anchor_passages" not in tiny_qa.ask(q, top_k=3, debias="none").settings  # full attention
    for mode in ("block", "block+recompute"):  # each block mode's own default
        assert tiny_qa.ask(q, top_k=3, attention=mode, debias="none").settings["anchor_passages"] == \
            DEFAULT_ANCHOR_PASSAGES[mode]
    # debiasing in block modes measures with the anchors: a bias curve of its own
    e = tiny_qa.engine
    assert e.bias_curve_path(3, "block", anchor_passages=2) != e.bias_curve_path(3, "block", anchor_passages=0)
    assert e.bias_curve_path(3, "block") == e.bias_curve_path(3, "block", anchor_passages=DEFAULT_ANCHOR_PASSAGES["block"])
    assert e.bias_curve_path(3, "full") == e.bias_curve_path(3, "full", anchor_passages=2)  # block modes only
    cr = tiny_qa.ask(q, top_k=3, attention="block", debias="calibrate+reorder", anchor_passages=2)
    assert cr.settings["anchor_passages"] == 2 and e.bias_curve_path(3, "block", anchor_passages=2).exists()
    for bad in (-1, 7, "2"):
        with pytest.raises(ValueError, match="anchor_passages"):
            tiny_qa.ask(q, attention="block", anchor_passages=bad)
