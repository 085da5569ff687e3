"""The web app (app/ui.py) through gradio_client against a server started here on a free localhost port:
ingest, ask with a streamed answer, bad files, an empty collection, two concurrent sessions, the Eval
tab; a tiny random-weight Gemma 3 for speed and, marked slow, the real Gemma 3 270M for citations."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402

from ldqa.app.api import LongDocQA  # noqa: E402
from ldqa.app.citations import Citation  # noqa: E402
from ldqa.app.ui import (UIConfig, Server, build_app, launch, passage_html, passage_records,  # noqa: E402
                         read_auth)

SAMPLE = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"
SETTINGS = dict(model=None, top_k=3, retriever="hybrid", attention="full", debias="none", max_new=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(store: Path, model: str, **cfg):
    """(url, qa, app) of a server on a free localhost port."""
    qa = LongDocQA(store=store, model=model, max_new_tokens=8)
    ui_cfg = UIConfig(**{"max_new_tokens": 8, **cfg})
    app = build_app(qa, ui_cfg)
    url = launch(app, ui_cfg, port=free_port(), block=False)
    return url, qa, app


@pytest.fixture
def ui(tmp_path, tiny_model_dir):
    """A client of a fresh server (tiny model, empty collection, 1 MB upload limit)."""
    model = str(tiny_model_dir("gemma3"))
    url, qa, app = start(tmp_path / "store", model, max_upload_mb=1)
    yield SimpleNamespace(url=url, qa=qa, model=model, client=Client(url, verbose=False))
    app.close()


def ask(client: Client, question: str, model: str, **kw) -> tuple[list, tuple]:
    """(every streamed output, the final output) of one question."""
    s = SETTINGS | {"model": model} | kw
    job = client.submit(question, [], s["model"], s["top_k"], s["retriever"], s["attention"], s["debias"],
                        s["max_new"], api_name="/ask")
    final = job.result()
    return job.outputs(), final


def text_of(message: dict) -> str:
    c = message["content"]
    return c if isinstance(c, str) else "".join(part.get("text", "") for part in c)


def test_ingest_ask_streams_and_delete(ui):
    rows, _, docs, _, _ = ui.client.predict([handle_file(SAMPLE / "sl30_manual.md"),
                                             handle_file(SAMPLE / "maintenance_log.txt")], api_name="/ingest")
    assert [(r[0], r[1]) for r in rows["data"]] == [("sl30_manual.md", "added"), ("maintenance_log.txt", "added")]
    assert all(int(r[2]) > 0 for r in rows["data"])
    assert {r[1] for r in docs["data"]} == {"sl30_manual.md", "maintenance_log.txt"}

    outputs, (chat, _, passages, viewer) = ask(ui.client, "Which error code means a humidity sensor fault?",
                                                  ui.model, max_new=8)
    assert len(outputs) >= 3  # the question, at least one streamed piece, the finished answer
    assert text_of(chat[0]) == "Which error code means a humidity sensor fault?"
    answer = text_of(chat[1])
    assert "TTFT" in answer and "tokens/s" in answer and "reused from the KV store" in answer
    assert len(passages["data"]) == 3
    for row in passages["data"]:  # hybrid: fused, dense and BM25 scores (a passage may miss one list)
        assert row[2] and (row[3] or row[4])
    assert "ldqa-passage" in viewer

    again, *_ = ui.client.predict([handle_file(SAMPLE / "sl30_manual.md")], api_name="/ingest")
    assert again["data"][0][1] == "skipped"
    manual = next(r[0] for r in docs["data"] if r[1] == "sl30_manual.md")
    msg, _, docs, _ = ui.client.predict(manual, api_name="/delete")
    assert "Deleted **sl30_manual.md**" in msg
    assert [r[1] for r in docs["data"]] == ["maintenance_log.txt"]
    assert not (ui.qa.store.path / "uploads" / "sl30_manual.md").exists()


def test_bad_files_get_a_per_file_error(ui, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >>\nnot a pdf")
    (bad / "notes.docx").write_bytes(b"PK\x03\x04")
    (bad / "good.txt").write_text("The pressure relief valve opens at 2.5 bar.\n")
    rows, *_ = ui.client.predict([handle_file(bad / n) for n in ("broken.pdf", "notes.docx", "good.txt")],
                                 api_name="/ingest")
    result = {r[0]: (r[1], r[3]) for r in rows["data"]}
    assert result["good.txt"][0] == "added"
    assert result["broken.pdf"][0] == "error" and result["broken.pdf"][1]
    assert result["notes.docx"] == ("error", "type '.docx' is not supported: upload PDF, TXT, MD or HTML")
    assert [d["path"] for d in ui.qa.documents()] == [str((ui.qa.store.path / "uploads" / "good.txt").resolve())]
    big = bad / "big.txt"
    big.write_text("lumber " * 200_000)  # 1.4 MB > the 1 MB limit: refused at upload
    with pytest.raises(Exception, match="(?i)size"):
        ui.client.predict([handle_file(big)], api_name="/ingest")


def test_question_before_any_document_gets_help(ui):
    _, (chat, *_) = ask(ui.client, "What is the maximum load?", ui.model)
    assert "No documents yet" in text_of(chat[-1]) and "Documents" in text_of(chat[-1])


def test_two_concurrent_sessions_get_their_own_answers(ui):
    ui.client.predict([handle_file(SAMPLE / "sl30_manual.md"), handle_file(SAMPLE / "maintenance_log.txt")],
                      api_name="/ingest")
    other = Client(ui.url, verbose=False)
    questions = {"a": "Which error code means a humidity sensor fault?",
                 "b": "On what date was circulation fan No. 2 replaced?"}
    got = {}

    def run(name, client):
        got[name] = ask(client, questions[name], ui.model, retriever="bm25", top_k=2)[1]

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", ui.client), ("b", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, q in questions.items():
        chat, _, passages, *_ = got[name]
        assert [text_of(m) for m in chat if m["role"] == "user"] == [q]
        alone = ui.qa.retrieve(q, top_k=2, retriever="bm25")  # each session got the passages of its question
        assert [r[1] for r in passages["data"]] == [Path(p.path).name for p in alone]


def test_eval_tab_runs_a_small_niah(ui):
    table, heatmap, ttft = ui.client.predict(ui.model, "full", "none", ["256"], ["0", "100"], False, api_name="/eval")
    assert "| full | 2 |" in table  # one mode, two (length, depth) cells
    assert Path(heatmap).is_file() and Path(ttft).is_file()


def test_a_question_over_the_window_gets_the_too_long_error_not_not_found(ui):
    from ldqa.app.api import ABSTAIN_BELOW

    ui.client.predict([handle_file(SAMPLE / "sl30_manual.md")], api_name="/ingest")
    over = "Which zebra crossed the savanna at noon? " * 500  # over the tiny model's 4096-token window
    # the relevance check alone would answer it "Not found": no passage is near its start
    assert max(p.dense_score for p in ui.qa.retrieve(over, top_k=3, retriever="dense")) < ABSTAIN_BELOW
    _, (chat, *_) = ask(ui.client, over, ui.model)
    reply = text_of(chat[-1])
    assert "Cannot answer" in reply and "context window of 4096 tokens" in reply and "shorten the question" in reply
    assert "Not found" not in reply


def _answer_cap(app):
    import gradio as gr

    return next(b for b in app.blocks.values() if isinstance(b, gr.Slider) and b.label == "Max new tokens")


def test_a_saved_answer_cap_is_shown_and_taken_up_to_the_models_window(tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("gemma3"))  # a window of 4096 tokens (conftest)
    qa = LongDocQA(store=tmp_path / "store", model=model)
    qa.save_answer_settings(1024)
    app = build_app(LongDocQA(store=tmp_path / "store", model=model))  # the saved cap, as `ldqa serve` starts
    cap = _answer_cap(app)
    assert cap.value == 1024 and cap.maximum == qa.context_length == 4096 and cap.minimum == 1
    for value in (1, 1024, 4096):
        assert cap.preprocess(value) == value  # taken as given, never refused
    served = _answer_cap(build_app(qa, UIConfig(max_new_tokens=6000)))  # a cap over the window is still shown
    assert served.value == 6000 and served.maximum == 6000 and served.preprocess(6000) == 6000
    srv = Server(qa, UIConfig())
    assert srv.answer_cap(model, 100).maximum == 4096  # another model's control: up to its window
    assert srv.answer_cap(model, 5000).maximum == 5000  # never below the value it holds


def test_a_saved_answer_cap_of_1024_never_refuses_a_question(tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("gemma3"))
    LongDocQA(store=tmp_path / "store", model=model).save_answer_settings(1024)
    app = build_app(LongDocQA(store=tmp_path / "store", model=model))
    try:
        client = Client(launch(app, UIConfig(), port=free_port(), block=False), verbose=False)
        _, (chat, *_) = ask(client, "What is the maximum load?", model, max_new=1024)
        assert "No documents yet" in text_of(chat[-1])  # the question reached the collection (it is empty)
    finally:
        app.close()


def test_passage_view_highlights_the_cited_span():
    p = SimpleNamespace(title="Manual", path="/x/manual.md", page=3, start=100, end=140,
                        text="Error E-14 <means> a humidity sensor fault.")
    c = Citation(1, 7, 1, "Manual", "/x/manual.md", 3, 100, 140, "contains", answer_start=106, answer_end=110)
    ans = SimpleNamespace(passages=[p], citations=[c])
    html = passage_html(passage_records(ans)[0])
    assert "[1] manual.md · page 3 · cited (holds the answer)" in html
    assert "Error <mark>E-14</mark> &lt;means&gt;" in html  # the span highlighted, the text escaped


def test_read_auth(tmp_path):
    f = tmp_path / "users"
    f.write_text("# users\nann:s3cret\nbob:pa:ss\n")
    assert read_auth(str(f), {}) == [("ann", "s3cret"), ("bob", "pa:ss")]
    f.write_text("ann\n")
    with pytest.raises(ValueError, match="line 1: expected user:password"):
        read_auth(str(f), {})
    assert read_auth(None, {"LDQA_UI_USER": "ann", "LDQA_UI_PASSWORD": "x"}) == [("ann", "x")]
    assert read_auth(None, {}) is None
    with pytest.raises(ValueError, match="both"):
        read_auth(None, {"LDQA_UI_USER": "ann"})


@pytest.mark.slow
def test_real_gemma_answer_cites_the_passage(tmp_path):
    url, qa, app = start(tmp_path / "store", "gemma3-270m")
    try:
        client = Client(url, verbose=False)
        client.predict([handle_file(p) for p in sorted(SAMPLE.iterdir())], api_name="/ingest")
        outputs, (chat, _, passages, _) = ask(client, "What is the maximum load of lumber the Korvel SL-30 kiln "
                                                      "chamber holds?", "gemma3-270m", top_k=5, max_new=24)
        assert len(outputs) > 3 and "3.2 cubic metre" in text_of(chat[1])
        cites = [m for m in chat[2:] if (m.get("metadata") or {}).get("title", "").startswith("[")]
        assert cites and "3.2 cubic metres" in text_of(cites[0]).split("<mark>")[1].split("</mark>")[0]
        assert any(r[5] for r in passages["data"])  # the cited passage is marked in the table
    finally:
        app.close()


# ---------------------------------------------------------------------- several users

USERS = [("ann", "ann-pw"), ("bob", "bob-pw")]
REPORTS = {"ann": "# Quarterly report\n\nThe Lille depot shipped 412 pallets of walnut veneer in March.\n",
           "bob": "# Quarterly report\n\nThe Porto depot shipped 977 crates of cork board in March.\n"}
QUESTION = "How much did the depot ship in March?"


def start_per_user(root: Path, model: str, shared_stores=()):
    """(url, qa, app) of a server with login and a collection per user under `root`, as `ldqa serve` lays
    it out."""
    from ldqa.app.collections import serve_layout

    store, users, _ = serve_layout(root, login=True)
    qa = LongDocQA(store=store, model=model, max_new_tokens=8)
    cfg = UIConfig(max_new_tokens=8, users_dir=users, shared_stores=tuple(shared_stores))
    app = build_app(qa, cfg)
    return launch(app, cfg, port=free_port(), auth=USERS, block=False), qa, app


def upload(client: Client, path: Path) -> list:
    """The ingestion results rows of one uploaded file."""
    rows, *_ = client.predict([handle_file(path)], api_name="/ingest")
    return rows["data"]


def documents(client: Client) -> list[str]:
    _, table, _ = client.predict(api_name="/documents")
    return [r[1] for r in table["data"]]


def test_with_login_each_user_is_answered_only_from_their_own_documents(tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("gemma3"))
    shared_dir = tmp_path / "handbook"
    (tmp_path / "handbook-src").mkdir()
    policy = tmp_path / "handbook-src" / "policy.md"
    policy.write_text("# Travel policy\n\nTrain tickets over 300 euros need a manager's approval.\n")
    LongDocQA(store=shared_dir, model=model).ingest([policy])
    url, qa, app = start_per_user(tmp_path / "store", model, shared_stores=[shared_dir])
    try:
        clients = {u: Client(url, auth=(u, pw), verbose=False) for u, pw in USERS}
        for user, client in clients.items():  # the same file name, different contents, one after the other
            f = tmp_path / user / "report.md"
            f.parent.mkdir()
            f.write_text(REPORTS[user])
            [row] = upload(client, f)
            assert row[:2] == ["report.md", "added"], row  # never "replaced": each user has their own
        for user, client in clients.items():
            assert documents(client) == ["report.md", "policy.md (shared)"]
            _, (chat, _, passages, viewer) = ask(client, QUESTION, model, retriever="bm25", top_k=3)
            mine, theirs = ("Lille", "Porto") if user == "ann" else ("Porto", "Lille")
            assert mine in viewer and theirs not in viewer  # the passage the answer rests on is the user's own
            assert [r[1] for r in passages["data"]] == ["report.md"]
            assert "reused from the KV store" in text_of(chat[1])  # a different prompt: nothing shared
            _, (_, _, passages, _) = ask(client, "Which train tickets need a manager's approval?", model,
                                         retriever="bm25")
            assert [r[1] for r in passages["data"]] == ["policy.md"]  # the shared collection is searched too
        ann_dir, bob_dir = (tmp_path / "store" / "users" / u for u in ("ann", "bob"))
        assert (ann_dir / "uploads" / "report.md").read_text() == REPORTS["ann"]
        assert (bob_dir / "uploads" / "report.md").read_text() == REPORTS["bob"]
        _, table, choices = clients["bob"].predict(api_name="/documents")
        assert [c[1] for c in choices["choices"]] == [table["data"][0][0]]  # only his own can be deleted
        msg, _, table, _ = clients["bob"].predict(table["data"][0][0], api_name="/delete")
        assert "Deleted **report.md**" in msg and [r[1] for r in table["data"]] == ["policy.md (shared)"]
        assert documents(clients["ann"]) == ["report.md", "policy.md (shared)"]
        assert (ann_dir / "uploads" / "report.md").exists() and LongDocQA(store=shared_dir, model=model).documents()
    finally:
        app.close()


def test_identical_passages_share_the_prefill_across_users_and_the_timing_line_says_so(tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("gemma3"))
    url, qa, app = start_per_user(tmp_path / "store", model)
    try:
        lines = {}
        for user, pw in USERS:  # the same file in two private collections: the same prompt, token for token
            client = Client(url, auth=(user, pw), verbose=False)
            upload(client, SAMPLE / "maintenance_log.txt")
            _, (chat, *_) = ask(client, "On what date was circulation fan No. 2 replaced?", model, retriever="bm25")
            lines[user] = text_of(chat[1])
        n = int(re.search(r"/([\d,]+) prompt tokens", lines["ann"]).group(1).replace(",", ""))
        assert f"0/{n:,} prompt tokens reused from the KV store" in lines["ann"]
        assert f"{n:,}/{n:,} prompt tokens reused from an identical earlier prompt's prefill" in lines["bob"]
    finally:
        app.close()


def test_a_prompt_prefilled_for_another_session_is_reported_as_reused(ui):
    upload(ui.client, SAMPLE / "maintenance_log.txt")
    q = "On what date was circulation fan No. 2 replaced?"
    first = text_of(ask(ui.client, q, ui.model, retriever="bm25")[1][0][1])
    again = text_of(ask(Client(ui.url, verbose=False), q, ui.model, retriever="bm25")[1][0][1])
    n = int(re.search(r"/([\d,]+) prompt tokens", first).group(1).replace(",", ""))
    assert f"0/{n:,} prompt tokens reused from the KV store" in first
    assert f"{n:,}/{n:,} prompt tokens reused from an identical earlier prompt's prefill" in again


def test_reuse_text_counts_stored_blocks_and_copied_prefills():
    from ldqa.app.api import Timings
    from ldqa.app.render import reuse_text
    from ldqa.attention.block_attention import PrefillStats
    from ldqa.attention.debias import DebiasStats

    assert reuse_text(Timings(prompt_tokens=90, reused_prefill_ms=0.0)) == \
        "0/90 prompt tokens reused from the KV store"
    assert reuse_text(Timings(prompt_tokens=90, reused_prefill_ms=812.0)) == \
        "90/90 prompt tokens reused from an identical earlier prompt's prefill"
    assert reuse_text(Timings(prompt_tokens=90, block_stats=PrefillStats(tokens_reused=60), reused_prefill_ms=0.0)) == \
        "60/90 prompt tokens reused from the KV store"
    debiased = reuse_text(Timings(prompt_tokens=90, reused_prefill_ms=812.0, debias_stats=DebiasStats(debias_passes=2)))
    assert debiased.startswith("0/90 prompt tokens reused from the KV store") and "812 ms of prefill reused" in debiased


def test_without_login_replacing_another_sessions_upload_says_so(ui, tmp_path):
    first, second = Client(ui.url, verbose=False), Client(ui.url, verbose=False)
    for name, client in (("ann", first), ("bob", second)):
        f = tmp_path / name / "report.md"
        f.parent.mkdir()
        f.write_text(REPORTS[name])
        [row] = upload(client, f)
        if name == "ann":
            assert row[1] == "added" and "another browser session" not in row[3]
        else:
            assert row[1] == "replaced" and "replaced the report.md another browser session uploaded" in row[3]
    (tmp_path / "bob" / "report.md").write_text(REPORTS["bob"] + "\nA second depot opened in April.\n")
    [row] = upload(second, tmp_path / "bob" / "report.md")  # the same session replacing its own upload
    assert row[1] == "replaced" and "another browser session" not in row[3]


def test_without_login_a_shared_store_is_searched_beside_the_collection(tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("gemma3"))
    policy = tmp_path / "policy.md"
    policy.write_text("# Travel policy\n\nTrain tickets over 300 euros need a manager's approval.\n")
    LongDocQA(store=tmp_path / "handbook", model=model).ingest([policy])
    url, qa, app = start(tmp_path / "store", model, shared_stores=[tmp_path / "handbook"])
    try:
        client = Client(url, verbose=False)
        upload(client, SAMPLE / "maintenance_log.txt")
        assert documents(client) == ["maintenance_log.txt", "policy.md (shared)"]
        _, (_, _, passages, _) = ask(client, "Which train tickets need a manager's approval?", model, retriever="bm25")
        assert passages["data"][0][1] == "policy.md"  # the best passage comes from the shared collection
        assert [Path(d["path"]).name for d in qa.documents()] == ["maintenance_log.txt"]  # uploads stay in --store
    finally:
        app.close()


def test_per_user_collections_need_a_login(tmp_path, tiny_model_dir):
    qa = LongDocQA(store=tmp_path / "store" / "shared", model=str(tiny_model_dir("gemma3")))
    cfg = UIConfig(users_dir=tmp_path / "store" / "users")
    with pytest.raises(ValueError, match="login"):
        launch(build_app(qa, cfg), cfg, port=free_port(), block=False)


def test_login_over_a_single_user_store_keeps_its_documents_reachable(tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("gemma3"))
    root = tmp_path / "store"
    url, qa, app = start(root, model)  # without login: the one collection, filled through the page
    try:
        upload(Client(url, verbose=False), SAMPLE / "maintenance_log.txt")
    finally:
        app.close()
        qa.store.close()
    url, qa, app = start_per_user(root, model)  # login turned on over it
    try:
        client = Client(url, auth=USERS[0], verbose=False)
        assert documents(client) == ["maintenance_log.txt (shared)"]
        _, (_, _, passages, viewer) = ask(client, "On what date was circulation fan No. 2 replaced?", model,
                                          retriever="bm25", top_k=2)
        assert {r[1] for r in passages["data"]} == {"maintenance_log.txt"} and "KV-FAN-220" in viewer
        assert (root / "shared" / "uploads" / "maintenance_log.txt").exists() and not (root / "uploads").exists()
    finally:
        app.close()


def test_sample_examples_only_where_the_sample_is_or_may_be_loaded(tmp_path):
    """The bundled sample's questions are offered as examples over a collection holding a sample document,
    or none yet (the sample is a button away), never over other documents."""
    from ldqa.app.ui import SAMPLE_DIR, sample_examples
    from ldqa.indexes.store import Store

    class Docs:
        def __init__(self, paths):
            self.paths = paths

        def documents(self):
            return [{"path": str(p)} for p in self.paths]

    sample = next((SAMPLE_DIR / "docs").iterdir())
    assert len(sample_examples([Docs([tmp_path / "mine.txt"]), Docs([sample])])) == 3
    assert sample_examples([Docs([tmp_path / "mine.txt"])]) == []
    assert sample_examples([Docs([tmp_path / "mine.txt"]), Store(tmp_path / "empty", "emb", 8)]) == []
    assert len(sample_examples([Store(tmp_path / "empty", "emb", 8)])) == 3 and len(sample_examples([])) == 3
