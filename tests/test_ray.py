"""ldqa's batch paths on Ray (`ldqa.app.ray_workers`, `ldqa.eval.ray_eval`): the same eval rows
and the same store with 2 local Ray workers as without Ray, a killed worker's examples re-queued (nothing
lost or written twice), and the message without Ray. Tiny random-weight Gemma 3 (conftest) and a local Ray
instance of 2 CPUs."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from ldqa.app import ray_workers
from ldqa.app.api import LongDocQA
from ldqa.app.cli import main
from ldqa.eval import harness, ray_eval

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'ldqa[ray]')")
TIMING = {"ttft_ms", "tokens_per_s", "total_ms", "peak_mb", "retrieval_ms", "created_at"}
RAY_SETTINGS = {"ray", "workers", "threads_per_worker", "out"}


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance of 2 CPUs for this module (ldqa uses it as it finds it), shut down after."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture
def one_thread():
    """The single-process baselines run on 1 torch thread, as each worker does."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(bench, data, out, model, **kw) -> harness.EvalConfig:
    base = dict(limit=2, max_new_tokens=4, progress=False, model=str(model))
    if bench == "nq-multidoc":
        base |= dict(modes="full,block", n_passages=3, gold_positions="1,3")
    return harness.EvalConfig(bench, str(data), str(out), **(base | kw))


def _rows(result) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in result["rows"]]


def _same_run(a, b) -> None:
    assert _rows(a) == _rows(b)
    assert [m["accuracy"] for m in a["modes"]] == [m["accuracy"] for m in b["modes"]]
    strip = lambda s: {k: v for k, v in s.items() if k not in RAY_SETTINGS}  # noqa: E731
    assert strip(a["settings"]) == strip(b["settings"])


@pytest.fixture(scope="module")
def nq_baseline(tiny_model_dir, nq_small, tmp_path_factory):
    """nq-multidoc (full, block) on 2 questions x 2 gold positions, without Ray, on 1 thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return harness.run(_cfg("nq-multidoc", nq_small, tmp_path_factory.mktemp("base"), tiny_model_dir("gemma3")))
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ no Ray

def test_without_ray_the_message_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when not installed
    with pytest.raises(RuntimeError, match=r"pip install 'ldqa\[ray\]'"):
        ray_workers.import_ray()
    data = tmp_path / "x.jsonl"
    data.write_text("{}\n")
    assert main(["eval", "jsonl", "--data", str(data), "--out", str(tmp_path / "o"), "--ray"]) == 2
    assert "pip install 'ldqa[ray]'" in capsys.readouterr().err
    assert main(["ingest", str(data), "--store", str(tmp_path / "s"), "--ray", "auto"]) == 2
    assert "pip install 'ldqa[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was loaded or written


@pytest.mark.parametrize("kw, match", [
    (dict(ray="local", workers=0), "--workers must be >= 1"),
    (dict(ray="local", threads_per_worker=0), "--threads-per-worker must be >= 1"),
    (dict(workers=2), "need --ray"),
    (dict(ray=" "), "--ray must be"),
    (dict(ray="docs/"), "put it after the paths"),  # `ldqa ingest --ray docs/` took the path as the address
])
def test_bad_ray_options_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        ray_workers.check_options(kw.get("ray"), kw.get("workers"), kw.get("threads_per_worker", 1))


# ------------------------------------------------------------------------------------------ eval

@needs_ray
def test_eval_on_two_workers_gives_the_single_process_rows(ray_local, tiny_model_dir, nq_small, nq_baseline, tmp_path):
    model, out = tiny_model_dir("gemma3"), tmp_path / "ray"
    first = harness.run(_cfg("nq-multidoc", nq_small, out, model, limit=1, ray="local", workers=2))
    assert first["computed"] == 4 and first["ray"] == {"workers": 2, "threads_per_worker": 1, "workers_lost": 0}
    # resume: a larger --limit dispatches only the missing rows; the result is the single-process run's
    res = harness.run(_cfg("nq-multidoc", nq_small, out, model, ray="local", workers=2))
    assert (res["computed"], res["cached"]) == (4, 4)
    _same_run(res, nq_baseline)
    assert any(r["attention_used"] == "block" for r in res["rows"])
    assert not list((out / "store").glob(ray_workers.PROBE_PREFIX + "*"))  # the probe file is removed


@needs_ray
def test_retrieval_benchmark_retrieves_on_the_driver(ray_local, tiny_model_dir, nq_small, tmp_path, one_thread,
                                                     monkeypatch):
    model = tiny_model_dir("gemma3")
    kw = dict(retriever="bm25", top_k=2, limit=3)
    base = harness.run(_cfg("retrieval", nq_small, tmp_path / "a", model, **kw))

    def driver_answers(*a, **k):
        raise AssertionError("the workers answer, never the driver")

    calls, real = [], harness.retrieve_for  # (the workers are other processes: these patches are the driver's)
    monkeypatch.setattr(harness, "retrieve_for", lambda *a: calls.append(a[2]["id"]) or real(*a))
    monkeypatch.setattr(harness, "answer_one", driver_answers)
    res = harness.run(_cfg("retrieval", nq_small, tmp_path / "b", model, **kw, ray="local", workers=2))
    assert sorted(calls) == sorted(r["example_id"] for r in base["rows"])  # each example retrieved here, once
    _same_run(res, base)
    assert all(r["n_passages"] == 2 and r["gold_rank"] is not None for r in res["rows"])


@needs_ray
def test_a_killed_worker_has_its_examples_requeued(ray_local, tiny_model_dir, nq_small, nq_baseline, tmp_path,
                                                   monkeypatch):
    class DyingWorker(ray_eval.EvalWorker):  # pickled by value: the first worker to answer dies mid-answer
        marker = str(tmp_path / "died")

        def answer(self, ex, mode):
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return super().answer(ex, mode)
            os._exit(1)  # the process ends without answering: Ray reports the actor dead

    monkeypatch.setattr(ray_eval, "EvalWorker", DyingWorker)
    puts = []
    real_put = harness.PredictionCache.put
    monkeypatch.setattr(harness.PredictionCache, "put",
                        lambda self, *a: puts.append((a[2], a[3])) or real_put(self, *a))
    out = tmp_path / "ray"
    res = harness.run(_cfg("nq-multidoc", nq_small, out, tiny_model_dir("gemma3"), ray="local", workers=2))
    assert Path(DyingWorker.marker).exists() and res["ray"]["workers_lost"] == 1
    assert res["computed"] == 8 and sorted(puts) == sorted(set(puts)) and len(puts) == 8  # each row written once
    with sqlite3.connect(out / "predictions.sqlite") as db:
        assert db.execute("SELECT count(*) FROM predictions").fetchone()[0] == 8
    _same_run(res, nq_baseline)


@needs_ray
def test_when_every_worker_dies_the_pool_says_so(ray_local):
    class Dies:
        def run(self, x):
            os._exit(1)

    pool = ray_workers.start_pool(ray_local, Dies, (), workers=1, threads=1)
    with pytest.raises(RuntimeError, match="every Ray worker died; 3 items were not done"):
        list(pool.map_unordered(lambda a, x: a.run.remote(x), [1, 2, 3]))
    assert pool.lost == 1
    with pytest.raises(ValueError, match="--workers 3 x --threads-per-worker 1 needs 3 CPUs; the Ray cluster has 2"):
        ray_workers.pool_size(ray_local, 3, 1)


# ------------------------------------------------------------------------------------------ ingest

def _corpus(folder: Path, shared_data: Path) -> list[Path]:
    """40 Markdown files from NQ passages, a duplicate in the same group of 32 and one in the next group,
    and a file that does not load."""
    folder.mkdir()
    with gzip.open(shared_data / "nq-open-oracle.jsonl.gz", "rt") as f:
        recs = [json.loads(line)["ctxs"][0] for _, line in zip(range(40), f)]
    for i, r in enumerate(recs):
        (folder / f"{i:03d}.md").write_text(f"# {r['title']}\n\n{r['text']}\n" * (1 + i % 3))
    (folder / "005-copy.md").write_bytes((folder / "005.md").read_bytes())
    (folder / "zz-copy-of-001.md").write_bytes((folder / "001.md").read_bytes())  # a copy in the second group
    (folder / "empty.txt").write_text("   \n")
    return sorted(folder.iterdir())


def _store_contents(qa) -> tuple:
    import numpy as np

    ids = qa.store.chunk_ids()
    keep = ("id", "doc_id", "title", "text", "header", "page", "start", "end")
    chunks = [{k: c.get(k) for k in keep} for c in qa.store.get_chunks(ids)]
    docs = [{k: d[k] for k in ("id", "path", "sha256", "n_chunks")} for d in qa.store.documents()]
    return docs, chunks, np.asarray(qa.store.get_vectors(ids))


def _kv_blocks(qa) -> dict:
    from ldqa.indexes.kv_store import KVBlockStore

    d = qa.store.path / "kv"
    with sqlite3.connect(d / "blocks.sqlite") as db:
        keys = sorted(r[0] for r in db.execute("SELECT key FROM blocks"))
    kv = KVBlockStore(d)
    try:
        return {k: kv.get(k) for k in keys}
    finally:
        kv.close()


@needs_ray
def test_ingest_on_ray_writes_the_same_store(ray_local, tiny_model_dir, shared_data, tmp_path, one_thread,
                                             monkeypatch):
    import numpy as np
    import torch

    from ldqa.app.api import LongDocQA

    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them; one of them missing
    files = [p.relative_to(tmp_path) for p in _corpus(tmp_path / "docs", shared_data)] + [Path("docs/gone.md")]
    model = str(tiny_model_dir("gemma3"))
    reports, contents, blocks = [], [], []
    for name, ray in (("plain", None), ("ray", "local")):
        qa = LongDocQA(store=tmp_path / name, model=model, weights="fp32", chunk_tokens=64, overlap_tokens=8)
        qa.ingest(files[3])  # stored before: the big ingest reports it skipped
        r = qa.ingest(files, ray=ray, workers=2 if ray else None)
        kv = qa.precompute_kv(ray=ray, workers=2 if ray else None)
        reports.append([(f.path, f.status, f.chunks, f.doc_id, f.reason) for f in r.files])
        contents.append(_store_contents(qa))
        blocks.append(_kv_blocks(qa))
        # repeated text makes equal blocks (one key); two workers may both compute one such block at once
        assert kv["blocks"] == qa.store.n_chunks() and kv["computed"] >= len(blocks[-1])
    assert reports[0] == reports[1]
    statuses = [s for _, s, *_ in reports[0]]
    assert statuses.count("skipped") == 3 and statuses.count("error") == 2 and statuses.count("added") == 39
    assert reports[0][-1][0] == "docs/gone.md"  # reported as given
    assert contents[0][:2] == contents[1][:2] and len(contents[0][1]) > 64
    assert np.array_equal(contents[0][2], contents[1][2])  # the same embedding batches: bit-identical vectors
    assert blocks[0].keys() == blocks[1].keys() and 64 < len(blocks[0]) <= len(contents[0][1])
    for k, b in blocks[0].items():
        assert torch.equal(b.keys, blocks[1][k].keys) and torch.equal(b.values, blocks[1][k].values)


@needs_ray
def test_ingest_on_ray_needs_the_files_on_every_worker(ray_local, tmp_path):
    worker = ray_workers.IngestWorker.__new__(ray_workers.IngestWorker)  # its check, without loading models
    with pytest.raises(FileNotFoundError, match="must be at the same path on every worker"):
        worker.prepare([str(tmp_path / "gone.md")], [True], frozenset())


def test_a_worker_that_cannot_see_the_store_keeps_its_kv_blocks_in_its_own(tiny_model_dir, nq_small, tmp_path):
    """Where the driver's store is not visible (another machine without a shared filesystem), an eval worker
    answers from a temporary store of its own; a precompute worker refuses, naming the fix."""
    import torch

    threads = torch.get_num_threads()
    try:
        with ray_workers.probe(tmp_path) as probe_path:  # what the driver writes; a worker elsewhere misses it
            assert ray_workers.reachable(probe_path)
        cfg = _cfg("nq-multidoc", nq_small, tmp_path / "out", tiny_model_dir("gemma3"))
        worker = ray_eval.EvalWorker(cfg, str(tmp_path / "store"), probe_path, 4, 1)
        assert worker.qa.store.path.name.startswith("ldqa-ray-store-") and not (tmp_path / "store").exists()
        with pytest.raises(RuntimeError, match="not visible on Ray node .* filesystem every worker reaches"):
            ray_workers.KVWorker(LongDocQA, str(tmp_path / "store"), probe_path, str(tiny_model_dir("gemma3")), "fp32",
                                 "fp32", 1)
    finally:
        torch.set_num_threads(threads)
