"""KVBlockStore tests on small random blocks (L=3 layers, 2 KV heads, head_dim 8)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import safetensors.torch
import torch

from ldqa.indexes.kv_store import (
    DB_NAME,
    KVBlock,
    KVBlockStore,
    KVStoreStats,
    block_key,
    kv_bytes_per_token,
)
from ldqa.indexes.store import Store
from ldqa.retrieval.types import Chunk, Document

L, KVH, D = 3, 2, 8


def make_block(n: int = 5, start: int = 0, seed: int = 0) -> KVBlock:
    """A float32 block (L, KVH, n, D) of random values."""
    g = torch.Generator().manual_seed(seed)
    return KVBlock(torch.randn(L, KVH, n, D, generator=g), torch.randn(L, KVH, n, D, generator=g), start)


def key(i: int) -> str:
    return block_key("fake-model", [], [i])


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("*.safetensors"))


@pytest.fixture
def kv(tmp_path):
    s = KVBlockStore(tmp_path / "kv")
    yield s
    s.close()


# ------------------------------------------------------------------ round trip and persistence
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip_exact_after_cast(tmp_path, dtype):
    block = make_block(n=17, start=42)
    with KVBlockStore(tmp_path / "kv", dtype=dtype) as s:
        s.put(key(1), block)
        mem = s.get(key(1))
    with KVBlockStore(tmp_path / "kv", dtype=dtype) as s:
        disk = s.get(key(1))
        assert s.stats.hits_disk == 1
    for got in (mem, disk):
        assert got.keys.dtype == dtype and got.values.dtype == dtype
        assert torch.equal(got.keys, block.keys.to(dtype)) and torch.equal(got.values, block.values.to(dtype))
        assert got.start == 42 and got.n_tokens == 17


def test_persists_across_instances_disk_hit_then_memory_hit(tmp_path):
    with KVBlockStore(tmp_path / "kv") as s:
        s.put(key(1), make_block(), chunk_id=7)
    with KVBlockStore(tmp_path / "kv") as s:
        assert s.get(key(1)) is not None
        assert (s.stats.hits_disk, s.stats.hits_memory) == (1, 0)
        assert s.get(key(1)) is not None
        assert (s.stats.hits_disk, s.stats.hits_memory) == (1, 1)
        assert s.drop_chunks([7]) == 1  # the chunk id survived the reopen and the promotion to memory
        assert s.get(key(1)) is None


def test_miss_and_hit_rate(kv):
    assert kv.stats.hit_rate == 0.0
    assert kv.get(key(9)) is None
    kv.put(key(1), make_block())
    kv.get(key(1))
    stats = kv.stats
    assert (stats.misses, stats.hits_memory, stats.puts) == (1, 1, 1)
    assert stats.hit_rate == 0.5
    assert stats.to_dict()["hit_rate"] == 0.5 and stats.to_dict()["puts"] == 1


def test_put_copies_input(kv):
    block = make_block()
    kv.put(key(1), block)
    expected = block.keys.to(torch.float16).clone()
    block.keys.zero_()
    assert torch.equal(kv.get(key(1)).keys, expected)


# ------------------------------------------------------------------ memory tier
def test_lru_evicts_least_recently_used(tmp_path):
    nbytes = make_block(n=10).nbytes // 2  # fp16 is half of float32
    with KVBlockStore(tmp_path / "kv", memory_budget_bytes=2 * nbytes) as s:
        s.put(key(1), make_block(n=10, seed=1))
        s.put(key(2), make_block(n=10, seed=2))
        s.get(key(1))  # 1 is now the most recently used
        s.put(key(3), make_block(n=10, seed=3))  # evicts 2
        stats = s.stats
        assert stats.evictions == 1 and stats.bytes_in_memory == 2 * nbytes
        assert s.get(key(1)) is not None and s.get(key(3)) is not None
        assert s.stats.hits_disk == 0
        evicted = s.get(key(2))  # still on disk
        assert s.stats.hits_disk == 1
        assert torch.equal(evicted.keys, make_block(n=10, seed=2).keys.half())


def test_memory_only_mode(tmp_path):
    nbytes = make_block(n=8).nbytes // 2
    s = KVBlockStore(None, memory_budget_bytes=nbytes)
    s.put(key(1), make_block(n=8), chunk_id=1)
    assert s.get(key(1)) is not None
    assert s.bytes_per_token() == kv_bytes_per_token(L, KVH, D, torch.float16)
    s.put(key(2), make_block(n=8), chunk_id=2)  # evicts 1, which is then gone for good
    assert s.get(key(1)) is None
    assert s.stats.entries_on_disk == 0 and s.stats.evictions == 1
    assert s.drop_chunks([2]) == 1 and s.get(key(2)) is None
    assert list(tmp_path.iterdir()) == []


def test_block_larger_than_budget_is_kept_on_disk_only(tmp_path):
    with KVBlockStore(tmp_path / "kv", memory_budget_bytes=10) as s:
        s.put(key(1), make_block())
        assert s.stats.bytes_in_memory == 0
        assert s.get(key(1)) is not None and s.stats.hits_disk == 1


# ------------------------------------------------------------------ corruption
def tensor_data_offset(path) -> int:
    data = path.read_bytes()
    return 8 + int.from_bytes(data[:8], "little")


def test_flipped_bytes_detected_and_deleted(tmp_path, caplog):
    with KVBlockStore(tmp_path / "kv", memory_budget_bytes=0) as s:
        s.put(key(1), make_block(n=20))
        path = tmp_path / "kv" / f"{key(1)}.safetensors"
        data = bytearray(path.read_bytes())
        off = tensor_data_offset(path) + 100
        data[off:off + 4] = bytes(b ^ 0xFF for b in data[off:off + 4])
        path.write_bytes(bytes(data))
        assert s.get(key(1)) is None
        assert not path.exists()
        stats = s.stats
        assert (stats.corrupt, stats.misses, stats.entries_on_disk) == (1, 1, 0)
        assert "corrupt" in caplog.text
        assert s.get(key(1)) is None and s.stats.corrupt == 1  # now a plain miss


def test_truncated_file_is_a_miss(tmp_path):
    with KVBlockStore(tmp_path / "kv", memory_budget_bytes=0) as s:
        s.put(key(1), make_block(n=20))
        path = tmp_path / "kv" / f"{key(1)}.safetensors"
        path.write_bytes(path.read_bytes()[:-50])
        assert s.get(key(1)) is None
        assert not path.exists() and s.stats.corrupt == 1


def _checksum(k, v) -> str:
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _bad_file(kind: str) -> bytes:
    """A well-formed safetensors file whose content is wrong in one way (checksum consistent unless said)."""
    k, v = torch.randn(L, KVH, 5, D).half(), torch.randn(L, KVH, 5, D).half()
    meta = {"start": "0", "n_tokens": "5", "format": "1"}
    if kind == "n_tokens":
        meta["n_tokens"] = "6"
    elif kind == "shape_mismatch":
        v = torch.randn(L, KVH, 4, D).half()
    elif kind == "three_dims":
        k, v = k[0], v[0]
    elif kind == "float32":
        k, v = k.float(), v.float()
    elif kind == "format":
        meta["format"] = "2"
    elif kind == "start":
        meta["start"] = "-3"
    meta["checksum"] = _checksum(k, v)
    if kind == "no_checksum":
        del meta["checksum"]
    if kind == "no_metadata":
        meta = None
    return safetensors.torch.save({"keys": k, "values": v}, metadata=meta)


@pytest.mark.parametrize("kind", ["ok", "n_tokens", "shape_mismatch", "three_dims", "float32", "format", "start",
                                  "no_checksum", "no_metadata", "garbage"])
def test_wrong_shapes_or_metadata_is_a_miss(tmp_path, kind):
    with KVBlockStore(tmp_path / "kv", memory_budget_bytes=0) as s:
        s.put(key(1), make_block())
        path = tmp_path / "kv" / f"{key(1)}.safetensors"
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" if kind == "garbage" else _bad_file(kind))
        got = s.get(key(1))
        if kind == "ok":  # the control: a hand-written valid file is accepted
            assert got is not None and s.stats.corrupt == 0
        else:
            assert got is None and not path.exists() and s.stats.corrupt == 1


# ------------------------------------------------------------------ invalidation
def test_drop_chunks_removes_only_those_chunks(kv, tmp_path):
    for i in range(4):
        kv.put(key(i), make_block(seed=i), chunk_id=i % 2)  # chunk 0: keys 0, 2; chunk 1: keys 1, 3
    kv.put(key(9), make_block())  # no chunk id
    assert kv.drop_chunks([0, 123]) == 2
    assert [kv.get(key(i)) is not None for i in (0, 1, 2, 3, 9)] == [False, True, False, True, True]
    assert len(files(tmp_path / "kv")) == 3 and kv.stats.entries_on_disk == 3
    assert kv.drop_chunks([]) == 0


def _doc(path: str, texts: list[str]) -> tuple:
    text = " ".join(texts)
    doc = Document(path=path, title="T", text=text, sha256=hashlib.sha256(text.encode()).hexdigest(), kind="txt")
    chunks, pos = [], 0
    for i, t in enumerate(texts):
        chunks.append(Chunk(text=t, start=pos, end=pos + len(t), n_tokens=len(t.split()), ordinal=i, page=None))
        pos += len(t) + 1
    vecs = np.eye(8, dtype=np.float32)[: len(texts)]
    return doc, chunks, vecs


def test_drop_chunks_as_store_hook(tmp_path, kv):
    store = Store(tmp_path / "st", "fake-8", 8)
    try:
        store.on_chunks_removed(kv.drop_chunks)
        a = store.add_document(*_doc("/d/a.txt", ["alpha one", "alpha two"]))
        b = store.add_document(*_doc("/d/b.txt", ["beta one"]))
        ids = {d: [r["id"] for r in store.db.query("SELECT id FROM chunks WHERE doc_id = ?", [d])] for d in (a, b)}
        for cid in ids[a] + ids[b]:
            kv.put(key(cid), make_block(seed=cid), chunk_id=cid)
        store.add_document(*_doc("/d/a.txt", ["alpha one, edited"]))  # replaces document a
        assert all(kv.get(key(c)) is None for c in ids[a])
        assert all(kv.get(key(c)) is not None for c in ids[b])
        assert kv.stats.entries_on_disk == len(ids[b])
    finally:
        store.close()


def test_clear(kv, tmp_path):
    kv.put(key(1), make_block())
    kv.clear()
    assert kv.get(key(1)) is None and files(tmp_path / "kv") == [] and kv.stats.bytes_in_memory == 0


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bytes_per_token_has_no_hidden_copies(tmp_path, dtype):
    with KVBlockStore(tmp_path / "kv", dtype=dtype) as s:
        assert s.bytes_per_token() == 0.0
        for i, n in enumerate((5, 13, 40)):
            s.put(key(i), make_block(n=n))
        per_token = kv_bytes_per_token(L, KVH, D, dtype)
        assert per_token == 2 * L * KVH * D * 2
        assert s.bytes_per_token() == per_token
        assert s.stats.bytes_on_disk == per_token * (5 + 13 + 40)
        for i, n in enumerate((5, 13, 40)):  # a file is the payload plus a small JSON header, nothing more
            size = (tmp_path / "kv" / f"{key(i)}.safetensors").stat().st_size
            assert 0 < size - per_token * n < 1024


# ------------------------------------------------------------------ keys
def test_block_key_depends_on_every_part():
    base = block_key("m", [1, 2], [3, 4])
    assert len(base) == 64 and int(base, 16) >= 0
    variants = [block_key("m2", [1, 2], [3, 4]), block_key("m", [1], [3, 4]), block_key("m", [1, 2], [3, 5]),
                block_key("m", [1, 2, 3], [4]), block_key("m", [], [1, 2, 3, 4])]
    assert len({base, *variants}) == 6
    assert block_key("m", np.array([1, 2]), (np.int32(3), 4)) == base
    with pytest.raises(TypeError, match="chunk_ids"):
        block_key("m", [1], [1.5])


def test_block_key_is_stable_across_processes():
    code = "from ldqa.indexes.kv_store import block_key; print(block_key('fp', [7, 8], [9]))"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == block_key("fp", [7, 8], [9])


# ------------------------------------------------------------------ concurrency and files
def test_concurrent_put_get(tmp_path):
    nbytes = make_block(n=6).nbytes // 2
    errors: list[BaseException] = []
    with KVBlockStore(tmp_path / "kv", memory_budget_bytes=3 * nbytes) as s:
        def work(t: int) -> None:
            try:
                for i in range(15):
                    k = key(100 * t + i)
                    s.put(k, make_block(n=6, seed=100 * t + i), chunk_id=t)
                    got = s.get(k)
                    assert torch.equal(got.keys, make_block(n=6, seed=100 * t + i).keys.half())
                    s.get(key(100 * ((t + 1) % 4) + i))  # another thread's block: hit or miss, never an error
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        stats = s.stats
        assert stats.entries_on_disk == 60 and stats.corrupt == 0 and stats.puts == 60
        assert stats.bytes_in_memory <= 3 * nbytes


_WRITER = """
import sys, time, torch
from pathlib import Path
from ldqa.indexes.kv_store import KVBlock, KVBlockStore, block_key
d, t = Path(sys.argv[1]), int(sys.argv[2])
s = KVBlockStore(d, memory_budget_bytes=0)  # every get reads the file
(d.parent / f"ready{t}").touch()
while not (d.parent / "go").exists():
    time.sleep(0.01)
for i in range(10 * t, 10 * t + 20):  # 10 keys shared with each neighbour, the same bytes (seeded by the key)
    g = torch.Generator().manual_seed(i)
    b = KVBlock(torch.randn(3, 2, 6, 8, generator=g), torch.randn(3, 2, 6, 8, generator=g), 0)
    s.put(block_key("fake-model", [], [i]), b, chunk_id=i)
    got = s.get(block_key("fake-model", [], [i]))
    assert got is not None and torch.equal(got.keys, b.keys.half()), i
s.close()
"""


def test_concurrent_writer_processes(tmp_path):
    """Three processes (as `ldqa ingest --precompute-kv --ray` workers) writing one directory at once, some
    keys by two of them: every block reads back verified, in the writers and in a store opened after."""
    d = tmp_path / "kv"
    KVBlockStore(d).close()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(d), str(t)], stderr=subprocess.PIPE, text=True)
             for t in range(3)]
    while not all((tmp_path / f"ready{t}").exists() for t in range(3)):
        assert all(p.poll() is None for p in procs), [p.communicate()[1] for p in procs]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0], [p.stderr.read() for p in procs]
    with KVBlockStore(d) as s:
        for i in range(40):
            want = make_block(n=6, seed=i)
            got = s.get(key(i))
            assert torch.equal(got.keys, want.keys.half()) and torch.equal(got.values, want.values.half())
        stats = s.stats
        assert stats.entries_on_disk == 40 and stats.corrupt == 0 and stats.misses == 0
    assert len(files(d)) == 40 and not list(d.glob(".tmp-*"))


def test_leftover_temp_and_orphan_files_on_open(tmp_path):
    d = tmp_path / "kv"
    with KVBlockStore(d) as s:
        s.put(key(1), make_block())
    young = d / f".tmp-{key(2)}.safetensors.abc"
    old = d / f".tmp-{key(3)}.safetensors.def"
    for p in (young, old):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    orphan = d / f"{key(4)}.safetensors"  # a block file without a row
    orphan.write_bytes(_bad_file("ok"))
    with KVBlockStore(d) as s:
        assert not old.exists() and young.exists()  # young ones may be another process's write in flight
        assert not orphan.exists()
        assert s.stats.entries_on_disk == 1 and s.get(key(1)) is not None and s.get(key(2)) is None
        assert s.stats.corrupt == 0


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, "float16"])
def test_refuses_other_dtypes(tmp_path, dtype):
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        KVBlockStore(tmp_path / "kv", dtype=dtype)


def test_refuses_directory_of_another_dtype(tmp_path):
    KVBlockStore(tmp_path / "kv").close()
    with pytest.raises(ValueError, match="holds float16 blocks"):
        KVBlockStore(tmp_path / "kv", dtype=torch.bfloat16)


def test_bad_keys_blocks_and_closed_store(tmp_path):
    s = KVBlockStore(tmp_path / "kv")
    with pytest.raises(ValueError, match="64-char"):
        s.get("../../etc/passwd")
    with pytest.raises(TypeError, match="KVBlock"):
        s.put(key(1), (torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ValueError, match="no tokens"):
        s.put(key(1), make_block(n=0))
    with pytest.raises(ValueError, match="same shape"):
        KVBlock(torch.zeros(L, KVH, 4, D), torch.zeros(L, KVH, 5, D), 0)
    with pytest.raises(TypeError, match="4-d float"):
        KVBlock(torch.zeros(L, 4, D), torch.zeros(L, 4, D), 0)
    with pytest.raises(ValueError, match="start"):
        KVBlock(torch.zeros(L, KVH, 4, D), torch.zeros(L, KVH, 4, D), -1)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        KVBlockStore(None, memory_budget_bytes=-1)
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.get(key(1))
    assert (tmp_path / "kv" / DB_NAME).exists()


def test_stats_is_a_snapshot(kv):
    snap = kv.stats
    kv.get(key(1))
    assert snap.misses == 0 and kv.stats.misses == 1
    assert isinstance(snap, KVStoreStats) and json.dumps(snap.to_dict())
