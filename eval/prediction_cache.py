"""The eval's prediction cache: one row per (settings hash, benchmark, mode, example id) in SQLite, so a
rerun answers only what is missing; `settings_hash` and `mode_cache_key` say what a cached answer was
computed with (tests/test_cache_keys.py pins them)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from ldqa.eval.answering import collection_settings
from ldqa.eval.config import EvalConfig, Mode
from ldqa.eval.examples import KV_ANSWER_PREFIX, KV_INSTRUCTION

class PredictionCache:
    """Per-example rows in SQLite (``DIR/predictions.sqlite``), keyed by (settings hash, benchmark, mode
    key, example id); each row is committed as soon as it is answered, so an interrupted run resumes."""

    def __init__(self, path: Path):
        import sqlite3

        self.db = sqlite3.connect(str(path))
        self.db.execute("CREATE TABLE IF NOT EXISTS predictions (config TEXT, benchmark TEXT, mode TEXT, "
                        "example_id TEXT, row TEXT, created_at REAL, "
                        "PRIMARY KEY (config, benchmark, mode, example_id))")

    def get(self, config: str, benchmark: str, mode: str, example_id: str) -> dict | None:
        r = self.db.execute("SELECT row, created_at FROM predictions WHERE config=? AND benchmark=? AND mode=? "
                            "AND example_id=?", (config, benchmark, mode, example_id)).fetchone()
        return json.loads(r[0]) | {"created_at": r[1]} if r else None

    def put(self, config: str, benchmark: str, mode: str, example_id: str, row: dict) -> float:
        now = time.time()
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO predictions VALUES (?, ?, ?, ?, ?, ?)",
                            (config, benchmark, mode, example_id, json.dumps(row), now))
        return now

    def close(self) -> None:
        self.db.close()


def settings_hash(cfg: EvalConfig, fingerprint: str, max_new: int, chat=None, device: str = "cpu",
                  kv_dtype: str = "fp32") -> str:
    """Hash of everything besides the mode and example id that changes a prediction (data, model,
    seed, lengths of answers and contexts, the chat template's text when the model is prompted through
    one: `chat`, a `ChatFormat`; the resolved `device` and `kv_dtype` unless cpu and fp32); --limit,
    --modes and the position lists are left out."""
    data = Path(cfg.data).resolve()
    size = data.stat().st_size if data.is_file() else sorted((p.name, p.stat().st_size) for p in data.glob("*.txt"))
    niah = Path(cfg.niah_config).read_text() if cfg.niah_config else ""
    key = [cfg.benchmark, str(data), size, cfg.model, fingerprint, max_new, cfg.seed, cfg.n_passages, cfg.kv_keys,
           cfg.top_k, cfg.passage_tokens, niah, cfg.recompute_ratio]
    if cfg.benchmark == "kv-retrieval":  # the task's own prompt (added after the first kv runs: new hash)
        key.append([KV_INSTRUCTION, KV_ANSWER_PREFIX])
    if cfg.max_length is not None:  # (unset keeps the hashes of runs without it)
        key.append(["max_length", cfg.max_length])
    if chat is not None:  # base-model prompts keep their hashes
        key.append(["chat", chat.opening + chat.lead, chat.closing, list(chat.stop_ids), list(chat.stop_strings)])
    if device != "cpu" or kv_dtype != "fp32":  # (the CPU's fp32 cache keeps the hashes of runs before devices)
        key.append(["device", device.split(":")[0], kv_dtype])
    return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:16]


def mode_cache_key(m: Mode, retrieval_config=None, cfg: EvalConfig | None = None) -> str:
    """The cache key of mode `m`: `Mode.key`, and a hash of the settings its resolved `AttentionConfig` runs with where
    they have defaults that may change: for attention "retrieval" its `RetrievalConfig` (`RetrievalConfig()` unless
    given), for the calibrate methods their measurement orders, calibration form and strength (--debias-strength
    where given). A changed default (e.g. `top_k_keys`) thus recomputes those answers instead of reading stale ones.
    The hashed dicts are built field by field here, not from `AttentionConfig` itself, so existing caches keep their
    keys (tests/test_cache_keys.py). A jsonl mode answered over per-record collections (`Mode.collection`) adds
    ``+collection#`` and a hash of `collection_settings(cfg)` (chunking, embedder, abstention threshold): its
    retriever is already in `Mode.key`, --top-k in `settings_hash`. Block modes whose blocks are encoded after
    anchor passages (--anchor-passages, else the mode's `DEFAULT_ANCHOR_PASSAGES`) add ``+anchorN``."""
    key = _attention_key(m, retrieval_config, cfg.recompute_select if cfg is not None else None,
                         cfg.recompute_ratio if cfg is not None else None,
                         cfg.debias_strength if cfg is not None else None)
    if cfg is not None and cfg.block_anchors and m.attention.startswith("block"):
        key += "+anchors"
    if m.attention.startswith("block"):  # the anchor passages its blocks are encoded after, when any
        from ldqa.attention.block_attention import anchor_passages_of

        n = anchor_passages_of(m.attention, cfg.anchor_passages if cfg is not None else None)
        if n:
            key += f"+anchor{n}"
    if m.collection:
        st = collection_settings(cfg)
        key += "+collection#" + hashlib.sha256(json.dumps(st, sort_keys=True).encode()).hexdigest()[:12]
    return key


def _attention_key(m: Mode, retrieval_config=None, recompute_select: str | None = None,
                   recompute_ratio: float | None = None, debias_strength: float | None = None) -> str:
    """`mode_cache_key` without the collection part (`debias_strength`: --debias-strength, hashed with the
    calibrate methods' settings, which resolve None to the default); block+recompute adds its recipe,
    ``+select=NAME@RATIO`` (`recompute_select` and `recompute_ratio`, else the defaults), unless it is
    CacheBlend's deviation at 0.15, the recipe of the keys without a suffix, and with a debias method
    that measures, ``+measured=block`` (where it measures the passages' attention)."""
    if m.attention == "hf":
        return m.key
    from ldqa.attention.engine import AttentionConfig
    from ldqa.attention.debias import DebiasConfig

    debias = DebiasConfig(m.debias)
    if debias.calibrates and debias_strength is not None:
        debias = DebiasConfig(m.debias, strength=debias_strength)
    cfg = AttentionConfig(m.attention, retrieval=retrieval_config, debias=debias).resolved()
    select, ratio = recompute_select or cfg.block.select, cfg.block.recompute_ratio
    if recompute_ratio is not None:
        ratio = recompute_ratio
    plain = m.attention != "block+recompute" or (select == "deviation" and ratio == 0.15)
    key = _debias_or_retrieval_key(m, cfg) + ("" if plain else f"+select={select}@{ratio:g}")
    if m.attention == "block+recompute" and cfg.debias.method in ("calibrate", "calibrate+reorder", "sort"):
        key += "+measured=block"  # the passages ranked on the plain block cache, then one recompute
    return key


def _debias_or_retrieval_key(m: Mode, cfg) -> str:
    d = cfg.debias
    if d.calibrates:
        fields = {"orders": d.orders, "calibration": d.calibration, "strength": d.strength}
    elif cfg.retrieval is not None:
        fields = asdict(cfg.retrieval)
    else:
        return m.key
    return m.key + "#" + hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]
