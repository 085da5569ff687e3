"""The web app's collections (app/collections.py): a single-user store moved into the per-user layout when
login is turned on (nothing lost, also when the move is interrupted), the layout checks, user directory
names, and the search over a user's collection and the shared ones. A tiny random-weight Gemma 3."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ldqa.app import collections
from ldqa.app.api import LongDocQA
from ldqa.app.collections import (MIGRATED, SHARED_DIR, STAGING, check_shared_store, migrate_to_per_user,
                                  serve_layout, user_dir_name)
from ldqa.indexes.store import DB_NAME, database_identity

SAMPLE = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"


@pytest.fixture
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("gemma3"))


def single_user_store(root: Path, model: str) -> dict:
    """A store as the web app leaves it without login: an uploaded file (in <root>/uploads), a file
    ingested from elsewhere, their KV blocks. Returns {path: sha256} of its documents."""
    qa = LongDocQA(store=root, model=model)
    (root / "uploads").mkdir(parents=True)
    shutil.copyfile(SAMPLE / "sl30_manual.md", root / "uploads" / "sl30_manual.md")
    qa.ingest([(root / "uploads" / "sl30_manual.md").resolve(), SAMPLE / "maintenance_log.txt"])
    qa.precompute_kv()
    docs = {d["path"]: d["sha256"] for d in qa.documents()}
    qa.store.close()
    qa.kv_store.close()
    return docs


def moved(docs: dict, root: Path) -> dict:
    """`docs` as they read after the move: uploads under <root>/shared/uploads, other paths unchanged."""
    old, new = str((root / "uploads").resolve()), str((root / SHARED_DIR / "uploads").resolve())
    return {p.replace(old, new, 1): sha for p, sha in docs.items()}


def check_shared(root: Path, docs: dict, model: str) -> None:
    """Every document of the old store is in <root>/shared, at its new path, searchable, its file there."""
    qa = LongDocQA(store=root / SHARED_DIR, model=model)
    assert {d["path"]: d["sha256"] for d in qa.documents()} == moved(docs, root)
    assert (root / SHARED_DIR / "uploads" / "sl30_manual.md").read_bytes() == (SAMPLE / "sl30_manual.md").read_bytes()
    hits = qa.retrieve("Which error code means a humidity sensor fault?", top_k=2, retriever="bm25")
    assert hits and all(Path(h.path).exists() for h in hits)
    assert qa.kv_store.stats.entries_on_disk > 0  # the KV blocks came along
    for name in (DB_NAME, "uploads", "kv", "vectors.faiss"):
        assert not (root / name).exists(), name


def test_login_moves_a_single_user_store_into_the_shared_collection(tmp_path, model):
    root = tmp_path / "store"
    docs = single_user_store(root, model)
    store, users, note = serve_layout(root, login=True)
    assert store == (root / SHARED_DIR).resolve() and users == (root / "users").resolve()
    assert "2 documents" in note and "shared" in note
    check_shared(root, docs, model)
    assert serve_layout(root, login=True)[2] == ""  # served again: nothing more to do
    with pytest.raises(ValueError, match="serve it with login"):  # without login: say how to reach it
        serve_layout(root, login=False)


def test_a_move_interrupted_before_the_switch_leaves_the_old_store_whole(tmp_path, model, monkeypatch):
    root = tmp_path / "store"
    docs = single_user_store(root, model)
    before = database_identity(root)

    def crash(*a):
        raise OSError("power cut")

    monkeypatch.setattr(collections.os, "rename", crash)
    with pytest.raises(OSError, match="power cut"):
        migrate_to_per_user(root)
    assert (root / STAGING).is_dir() and not (root / SHARED_DIR).exists()  # the half copy, beside the original
    assert database_identity(root) == before
    assert {d["path"]: d["sha256"] for d in LongDocQA(store=root, model=model).documents()} == docs
    monkeypatch.undo()
    assert "2 documents" in migrate_to_per_user(root)  # the next start discards the half copy and moves it
    assert not (root / STAGING).exists()
    check_shared(root, docs, model)


def test_a_move_interrupted_after_the_switch_is_finished_on_the_next_start(tmp_path, model, monkeypatch):
    root = tmp_path / "store"
    docs = single_user_store(root, model)
    real_unlink = Path.unlink

    def crash_at_the_database(self, missing_ok=False):
        if self.name == DB_NAME:
            raise OSError("power cut")
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", crash_at_the_database)
    with pytest.raises(OSError, match="power cut"):
        migrate_to_per_user(root)
    monkeypatch.undo()
    assert (root / DB_NAME).exists() and (root / SHARED_DIR / MIGRATED).exists()
    assert "finished moving" in migrate_to_per_user(root)
    check_shared(root, docs, model)


def test_a_collection_made_in_the_store_after_the_move_is_not_removed(tmp_path, model):
    root = tmp_path / "store"
    single_user_store(root, model)
    migrate_to_per_user(root)
    LongDocQA(store=root, model=model).ingest([SAMPLE / "sl30_manual.md"])  # e.g. `ldqa ingest --store <root>`
    with pytest.raises(ValueError, match="holds a collection of its own") as e:
        serve_layout(root, login=True)
    assert f"--store {root.resolve() / SHARED_DIR}" in str(e.value)
    assert LongDocQA(store=root, model=model).documents()  # still there


def test_a_fresh_store_gets_the_per_user_layout_and_a_single_one_stays_as_it_is(tmp_path):
    assert serve_layout(tmp_path / "new", login=True) == ((tmp_path / "new" / SHARED_DIR).resolve(),
                                                          (tmp_path / "new" / "users").resolve(), "")
    assert serve_layout(tmp_path / "one", login=False) == ((tmp_path / "one").resolve(), None, "")


def test_user_directory_names_are_safe_and_distinct():
    assert user_dir_name("ann") == "ann"
    names = [user_dir_name(n) for n in ("Ann", "ann", "a/n n", "a_n_n", "../etc", "ann@example.org")]
    assert len(set(names)) == len(names)
    assert all("/" not in n and not n.startswith(".") for n in names)
    with pytest.raises(ValueError, match="log in"):
        user_dir_name("")


def test_shared_store_option_is_checked(tmp_path, model):
    root = tmp_path / "store"
    with pytest.raises(ValueError, match="--shared-store .*no collection there"):
        check_shared_store(tmp_path / "nope", root, login=False)
    LongDocQA(store=tmp_path / "handbook", model=model)
    assert check_shared_store(tmp_path / "handbook", root, login=True) == (tmp_path / "handbook").resolve()
    LongDocQA(store=root / "users" / "ann", model=model)
    with pytest.raises(ValueError, match="private collection"):
        check_shared_store(root / "users" / "ann", root, login=True)
    with pytest.raises(ValueError, match="served store itself"):
        check_shared_store(root / "users" / "ann", root / "users" / "ann", login=False)


def test_a_users_search_covers_their_collection_and_the_shared_one(tmp_path, model):
    shared = LongDocQA(store=tmp_path / "shared", model=model)
    shared.ingest([SAMPLE / "maintenance_log.txt"])
    ann = shared.with_store(tmp_path / "ann", search_also=[shared.store])
    ann.ingest([SAMPLE / "sl30_manual.md"])
    assert [d["path"] for d in ann.documents()] == [str(SAMPLE / "sl30_manual.md")]  # ingest went to hers only
    assert [d["path"] for d in shared.documents()] == [str(SAMPLE / "maintenance_log.txt")]
    q = "Which error code means a humidity sensor fault? When was circulation fan No. 2 replaced?"
    for mode in ("hybrid", "dense", "bm25"):
        got = ann.retrieve(q, top_k=6, retriever=mode)
        assert {Path(p.path).name for p in got} == {"sl30_manual.md", "maintenance_log.txt"}, mode
        alone = {Path(p.path).name for p in shared.retrieve(q, top_k=6, retriever=mode)}
        assert alone == {"maintenance_log.txt"}  # the shared collection never sees hers
    dense = ann.retrieve(q, top_k=6, retriever="dense")
    assert [p.dense_score for p in dense] == sorted((p.dense_score for p in dense), reverse=True)
    assert ann.prefill_memo is shared.prefill_memo and ann.kv_store is not shared.kv_store
