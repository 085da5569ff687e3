"""``ldqa eval --ray``: the missing answers of a `harness.run` computed by a pool of Ray actors.

The driver (`harness.run`) builds the examples, reads and writes ``predictions.sqlite`` and shows the
progress bar; `eval_rows` sends each missing (example, mode) to an `EvalWorker`, which answers it with
`answering.answer_one` as the single-process run does (retrieval benchmark: retrieved on the driver first,
with the driver's `retrieve`). The harness imports this module, never the reverse.
What runs where, KV blocks across workers, and why an actor pool: `ldqa.app.ray_workers`.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from ldqa.app.ray_workers import set_threads, connected, probe, reachable, start_pool
from ldqa.eval.answering import HFReference, answer_one

log = logging.getLogger(__name__)


class EvalWorker:
    """A Ray actor of ``ldqa eval --ray``: one `LongDocQA` (the LLM loaded once) answering examples with
    `answering.answer_one`. store: the driver's store directory, used for its KV blocks when `probe` is
    reachable, else a temporary one of this worker's."""

    def __init__(self, cfg, store: str, probe_path: str, max_new: int, threads: int):
        from ldqa.app.api import LongDocQA

        set_threads(threads, cfg.seed)
        if not reachable(probe_path):
            store = tempfile.mkdtemp(prefix="ldqa-ray-store-")
            log.warning("ldqa eval --ray: the store is not visible on this node; KV blocks go to %s", store)
        self.cfg, self.max_new, self.hf = cfg, max_new, None
        self.qa = LongDocQA(store=store, model=cfg.model, max_new_tokens=max_new, weights=cfg.weights,
                            chat_template=cfg.chat_template, device=cfg.device, kv_dtype=cfg.kv_dtype)
        self.qa.llm  # noqa: B018  (load now, not in the first answer)

    def answer(self, ex: dict, mode) -> dict:
        """The result row of `ex` in `mode` (`answering.answer_one`)."""
        if mode.attention == "hf" and self.hf is None:
            self.hf = HFReference(self.qa.llm)
        return answer_one(self.qa, self.hf, self.cfg, ex, mode, self.max_new)


def eval_rows(cfg, qa, todo: list, max_new: int, info: dict, retrieve):
    """Yields (example, mode, row) for each (example, mode) of `todo`, answered on a Ray pool (`cfg.ray`,
    `cfg.workers`, `cfg.threads_per_worker`) as the workers finish; the caller (`harness.run`) writes
    them. For the retrieval benchmark the passages are retrieved here, on the driver, with
    retrieve(qa, cfg, example, mode) -> the example with its passages (the harness's
    `answering.retrieve_for`). Fills `info` with {"workers", "threads_per_worker", "workers_lost"}.
    Raises RuntimeError without Ray."""
    from dataclasses import replace

    with connected(cfg.ray) as ray, probe(qa.store.path) as probe_path:
        model = cfg.model if cfg.model is None or not Path(cfg.model).exists() else str(Path(cfg.model).resolve())
        worker_cfg = replace(cfg, model=model)
        pool = start_pool(ray, EvalWorker, (worker_cfg, str(qa.store.path.resolve()), probe_path, max_new,
                                            cfg.threads_per_worker), cfg.workers, cfg.threads_per_worker)

        def call(actor, item):
            ex, m = item
            if cfg.benchmark == "retrieval":
                ex = retrieve(qa, cfg, ex, m)
            return actor.answer.remote(ex, m)

        info.update(workers=len(pool.actors), threads_per_worker=cfg.threads_per_worker, workers_lost=0)
        try:
            for i, row in pool.map_unordered(call, todo):
                yield todo[i][0], todo[i][1], row
        finally:
            info["workers_lost"] = pool.lost
            pool.close()
