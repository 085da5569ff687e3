"""ldqa's batch paths on Ray: ``ldqa eval --ray``, ``ldqa ingest --ray`` and its ``--precompute-kv``.

What runs where
---------------
The driver (the process that runs ``ldqa``) builds the work, owns every SQLite file and shows the
progress bar; a pool of Ray actors (``--workers N``, default one per CPU slot Ray reports, each with
``--threads-per-worker`` torch threads and that many Ray CPUs) does the compute, each loading its models
once:

- eval (`ldqa.eval.ray_eval`, built on this module): the driver builds the examples, reads
  ``predictions.sqlite`` and sends only the missing (example, mode) pairs; a worker answers each with
  `answering.answer_one`, the call the single-process run makes; for the retrieval benchmark the driver
  retrieves first (milliseconds) and sends the passages (seconds of answering), so no worker needs the
  collection. The driver writes each row as it arrives.
- ingest: a worker loads, chunks and embeds one group of 32 files (`retrieval.ingest.prepare_group`, the
  batch the single-process path embeds together, so the vectors are bit-identical); the driver writes
  the groups in order, each file in its own transaction (`write_group`), as without Ray.
- ``--precompute-kv``: workers encode chunks' KV blocks and write them to the store's ``kv/`` directory
  themselves (`KVBlockStore` writes each block atomically; concurrent writers are safe).

KV blocks during eval: a worker uses the store's ``kv/`` directory when it can see it (one machine, or
a shared filesystem; checked with a probe file the driver writes), else a store of its own in a temporary
directory: it then computes every block it needs once per worker (no sharing between workers or runs;
blocks are answer-neutral, so results are the same). ``--precompute-kv --ray`` needs the store
reachable by every worker and says so when it is not; ``ingest --ray`` needs the input files at the same
path on every worker.

Why an actor pool and not Ray Data ``map_batches``: the three paths need the same three things, which a
20-line ``ray.wait`` loop (`ActorPool`) gives directly: models loaded once per worker, results back on
the driver (which alone writes SQLite, in order for ingest), and a dead worker's item re-queued to the
others. Ray Data would add its streaming executor and pyarrow/pandas blocks for a few thousand files of
seconds each, and a second mechanism to test.

Results: identical to the single-process run (greedy decoding; a test compares rows, stores and KV
blocks). A worker cannot know that a file repeats one of an earlier group of the same ingest (stored
while it worked), so it embeds that copy with its group; the driver then drops it and embeds the rest of
that group again itself, in the batch a run without Ray makes (MiniLM pads a batch to its longest text,
so batch composition moves vectors in the last bit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

EXTRA_HINT = "pip install 'ldqa[ray]'"
PROBE_PREFIX = ".ray-probe-"


def import_ray():
    """The `ray` module. Raises RuntimeError naming the optional extra when Ray is not installed."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"--ray needs Ray, an optional extra of ldqa: {EXTRA_HINT} (or `make install`) "
                           f"[{e}]") from e
    return ray


def add_arguments(p) -> None:
    """``--ray [ADDRESS]``, ``--workers N`` and ``--threads-per-worker N`` on argparse parser `p`."""
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray: '--ray local' (or --ray last on the line), a new local Ray instance; with "
                        f"an address ('auto', 'ray://host:10001'), that cluster (needs {EXTRA_HINT}). --ray takes "
                        "the next word as its address: put it after the positional arguments (paths, a benchmark name)")
    p.add_argument("--workers", type=int, default=None,
                   help="--ray: worker actors (default: one per CPU slot Ray reports, divided by --threads-per-worker)")
    p.add_argument("--threads-per-worker", type=int, default=1, help="--ray: torch threads (and Ray CPUs) per worker")


def check_options(ray: str | None, workers: int | None, threads_per_worker: int) -> None:
    """Checks the Ray options before anything is loaded. Raises ValueError naming --ray, --workers or
    --threads-per-worker when out of range or given without --ray; RuntimeError naming the extra when
    --ray is given and Ray is not installed."""
    if ray is not None and (not isinstance(ray, str) or not re.fullmatch(r"local|auto|\w+://\S+|[\w.\-]+:\d+", ray)):
        raise ValueError(f"--ray must be 'local' or a Ray address ('auto', 'ray://host:10001', 'host:6379'), got "
                         f"{ray!r}; --ray takes the next word as its address, so put it after the paths or the "
                         "benchmark, or write --ray local")
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise ValueError(f"--workers must be >= 1, got {workers!r}")
    if isinstance(threads_per_worker, bool) or threads_per_worker < 1:
        raise ValueError(f"--threads-per-worker must be >= 1, got {threads_per_worker!r}")
    if ray is None and (workers is not None or threads_per_worker != 1):
        raise ValueError("--workers and --threads-per-worker need --ray")
    if ray is not None:
        import_ray()


@contextlib.contextmanager
def connected(address: str):
    """Yields the `ray` module connected to `address`: "local" starts a local instance (no dashboard),
    another value ("auto", "ray://host:10001") joins that cluster. A Ray already initialized in this
    process is used as it is and left running; one started here is shut down on exit.
    Raises RuntimeError when Ray is not installed (`import_ray`)."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    kw = {"include_dashboard": False} if address == "local" else {"address": address}
    ray.init(**kw, logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        ray.shutdown()


def pool_size(ray, workers: int | None, threads: int) -> int:
    """Workers to start: `workers`, or the CPU slots Ray reports free divided by `threads` (at least 1).
    Raises ValueError when the cluster has fewer CPUs than workers x threads (the extra actors would wait
    forever)."""
    total = int(ray.cluster_resources().get("CPU", 0))
    n = workers if workers is not None else max(1, int(ray.available_resources().get("CPU", 0)) // threads)
    if n * threads > total:
        raise ValueError(f"--workers {n} x --threads-per-worker {threads} needs {n * threads} CPUs; the Ray "
                         f"cluster has {total}")
    return n


class ActorPool:
    """Items dispatched over Ray actors, one in flight per actor, with dead actors' items re-queued.

    `lost` counts actors that died (`RayActorError`) during `map_unordered`; their in-flight items went
    back to the queue for the others, so every item is done exactly once.
    """

    def __init__(self, ray, actors: list):
        self.ray, self.actors, self.lost = ray, list(actors), 0

    def map_unordered(self, call, items):
        """Yields (index, result) for every item of `items` as it is done; call(actor, item) -> ObjectRef.
        An application error in a call propagates (as the single-process loop's would). Raises
        RuntimeError when every actor has died, saying how many items were left."""
        from ray.exceptions import RayActorError

        queue, idle, running = deque(enumerate(items)), list(self.actors), {}
        while queue or running:
            while idle and queue:
                actor = idle.pop(0)
                i, item = queue.popleft()
                running[call(actor, item)] = (actor, i, item)
            if not running:
                raise RuntimeError(f"every Ray worker died; {len(queue)} items were not done (the finished "
                                   "ones are kept: run the same command to resume)")
            [ref], _ = self.ray.wait(list(running), num_returns=1)
            actor, i, item = running.pop(ref)
            try:
                result = self.ray.get(ref)
            except RayActorError as e:
                self.lost += 1
                log.warning("a Ray worker died (%s); its item goes back to the queue (%d workers left)",
                            type(e).__name__, len(idle) + len(running))
                with contextlib.suppress(Exception):
                    self.ray.kill(actor)
                queue.appendleft((i, item))
                continue
            idle.append(actor)
            yield i, result

    def close(self) -> None:
        """Kill every actor of the pool (their processes end; a Ray started by `connected` stays up)."""
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)

    def map(self, call, items):
        """Like `map_unordered`, but yields the results in the order of `items` (finished ones wait)."""
        done, nxt = {}, 0
        for i, result in self.map_unordered(call, items):
            done[i] = result
            while nxt in done:
                yield done.pop(nxt)
                nxt += 1


def start_pool(ray, cls, args: tuple, workers: int | None, threads: int) -> ActorPool:
    """`pool_size` actors of class `cls` (constructed with `args`), each reserving `threads` Ray CPUs."""
    n = pool_size(ray, workers, threads)
    remote = ray.remote(num_cpus=threads, max_restarts=0)(cls)
    return ActorPool(ray, [remote.remote(*args) for _ in range(n)])


@contextlib.contextmanager
def probe(directory: Path):
    """A file in `directory` whose path a worker checks (`reachable`) to know it sees the driver's
    directory; removed on exit. Yields its absolute path as a str."""
    path = Path(directory).resolve() / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    path.write_text("ldqa\n")
    try:
        yield str(path)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def reachable(probe_path: str) -> bool:
    """Whether this process sees the probe file the driver wrote (same machine or a shared filesystem)."""
    return Path(probe_path).is_file()


def set_threads(threads: int, seed: int | None = None) -> None:
    """A worker's torch threads (also those of ldqa's q8_0 kernel; decode keeps them: $LDQA_DECODE_THREADS)
    and, if given, its torch seed."""
    import os

    import torch

    torch.set_num_threads(threads)
    os.environ["LDQA_DECODE_THREADS"] = str(threads)  # the worker's share of the cores, not the governor's
    if seed is not None:
        torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------ ingest

class IngestWorker:
    """A Ray actor of ``ldqa ingest --ray``: the embedder and the LLM's tokenizer (chunk sizes are in its
    tokens) loaded once; `prepare` is `retrieval.ingest.prepare_group` on one group of files."""

    def __init__(self, model_name: str, chunk_config, threads: int):
        from ldqa.attention.loader import load_tokenizer
        from ldqa.retrieval.embedders import Embedder

        set_threads(threads)
        self.embedder, self.chunk_config = Embedder(), chunk_config
        self.count = load_tokenizer(model_name).count

    def prepare(self, paths: list, on_driver: list, stored_shas) -> tuple:
        """`prepare_group` of `paths` (files whose sha256 is in `stored_shas` are not chunked). Raises
        FileNotFoundError when a path the driver sees (`on_driver`, one bool per path) is not visible on
        this node (the files must be on a filesystem every worker reaches), rather than reporting the
        files as unreadable; a path missing on the driver too is that file's error result, as without Ray."""
        from ldqa.retrieval.ingest import prepare_group

        missing = [str(p) for p, there in zip(paths, on_driver) if there and not Path(p).exists()]
        if missing:
            raise FileNotFoundError(f"ldqa ingest --ray: {missing[0]} (and {len(missing) - 1} more) not found on "
                                    f"Ray node {os.uname().nodename}; the files must be at the same path on "
                                    "every worker (one machine or a shared filesystem)")
        return prepare_group(stored_shas.__contains__, self.embedder, self.count, self.chunk_config, paths)


def prepare_on_ray(ray, qa, workers: int | None, threads: int):
    """The `prepare_groups` argument of `retrieval.ingest.ingest_files` for `qa`'s collection: groups ->
    their `prepare_group` results, computed by a pool of `IngestWorker`s, yielded in order. Files whose
    bytes the store holds when the ingest starts are not chunked or embedded by the workers."""
    from ldqa.retrieval.ingest import PreparedFile

    def as_given(group, result):  # the workers saw absolute paths; reports name the files as the caller did
        for p, x in zip(group, result[0]):
            if isinstance(x, PreparedFile):
                x.given = str(Path(p))
            else:
                x.path = str(Path(p))
        return result

    def batch_as_here(result):
        """`result` with the embedding batch this process would have made now that the earlier groups
        are stored: a file whose bytes an earlier group of this ingest stored leaves the batch (it is
        reported skipped), and then the rest is embedded again here, in one batch, so its vectors are
        bit-identical to a run without Ray (MiniLM pads a batch to its longest text). Rare: the same
        bytes twice in one ingest, in different groups of 32."""
        prepared = [x for x in result[0] if isinstance(x, PreparedFile) and x.chunks is not None]
        late = [x for x in prepared if qa.store.get_document_by_sha(x.doc.sha256) is not None]
        if late:
            for x in late:
                x.chunks = x.vectors = None
            todo = [x for x in prepared if x.chunks is not None]
            vectors, row = qa.embedder.encode([c.full_text for x in todo for c in x.chunks]), 0
            for x in todo:
                x.vectors, row = vectors[row:row + len(x.chunks)], row + len(x.chunks)
        return result

    def prepare_groups(groups):
        shas = ray.put(frozenset(d["sha256"] for d in qa.store.documents()))
        pool = start_pool(ray, IngestWorker, (qa.model_name, qa.chunk_config, threads), workers, threads)

        def call(actor, group):
            paths = [str(Path(p).resolve()) for p in group]
            return actor.prepare.remote(paths, [Path(p).exists() for p in group], shas)

        try:
            for group, result in zip(groups, pool.map(call, groups)):
                yield batch_as_here(as_given(group, result))  # lazily: the groups before are stored now
        finally:
            pool.close()

    return prepare_groups


class KVWorker:
    """A Ray actor of ``ldqa ingest --precompute-kv --ray``: a `LongDocQA` on the driver's store (reached
    directly: one machine or a shared filesystem) encoding chunks' KV blocks into its ``kv/`` directory.
    qa_class: the driver's `LongDocQA` class (given by the caller, `precompute_on_ray`: this module sits
    below `ldqa.app.api`, which imports it)."""

    def __init__(self, qa_class, store: str, probe_path: str, model_name: str, weights: str, kv_dtype: str,
                 threads: int, chat_template: str = "auto", device: str = "cpu"):
        if not reachable(probe_path):
            raise RuntimeError(f"--precompute-kv --ray: the store {store} is not visible on Ray node "
                               f"{os.uname().nodename}; put it on a filesystem every worker reaches, or "
                               "precompute without --ray")
        set_threads(threads)
        self.qa = qa_class(store=store, model=model_name, weights=weights, kv_dtype=kv_dtype,
                           chat_template=chat_template, device=device)  # the same prompt prefix as the driver's: the same block keys

    def encode(self, rows: list[dict], attention: str = "block") -> tuple[int, int]:
        """Encode and store the blocks of chunk `rows` as block mode `attention` reads them
        (`LongDocQA.encode_rows`); returns how many were computed (the rest were in the store already) and
        their tokens."""
        stats = self.qa.encode_rows(rows, attention=attention)
        return stats.kv_misses, stats.tokens_computed


def precompute_on_ray(ray, qa, rows: list[dict], workers: int | None, threads: int, on_rows=None,
                      attention: str = "block") -> tuple[int, int]:
    """Encode the KV blocks of chunk `rows` of `qa`'s collection, as block mode `attention` reads them, on a
    pool of `KVWorker`s (each with a `type(qa)` on the store), 16 chunks a task; on_rows(n) after each task
    (a progress bar). Returns the number of blocks computed and their tokens. Raises RuntimeError when a
    worker cannot reach the store."""
    if not rows:
        return 0, 0
    batches = [rows[i:i + 16] for i in range(0, len(rows), 16)]
    with probe(qa.store.path) as probe_path:
        pool = start_pool(ray, KVWorker, (type(qa), str(qa.store.path.resolve()), probe_path, qa.model_name,
                                          qa.weights, qa.kv_dtype, threads, qa.chat_template, qa.device), workers,
                          threads)
        computed = tokens = 0
        try:
            for i, (n, t) in pool.map_unordered(lambda actor, b: actor.encode.remote(b, attention), batches):
                computed, tokens = computed + n, tokens + t
                if on_rows is not None:
                    on_rows(len(batches[i]))
        finally:
            pool.close()
    return computed, tokens
