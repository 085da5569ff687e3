"""Ray's own overhead for ldqa's batch paths: ``python -m ldqa.eval.bench.bench_ray [--workers 2] [--calls 200]``.

Prints, in seconds: ``ray.init`` of a local instance (no dashboard), the start of `--workers` empty actors
(process start, to the first answered call), and the round trip of one call to an actor that does nothing
(median over `--calls` sequential calls, the per-task overhead `ActorPool` adds to each answer or file
group), plus the same for a call carrying one nq-multidoc example (10 passages, about 7 KB pickled).
"""

from __future__ import annotations

import argparse
import statistics
import time


class Echo:
    """An actor that returns its argument's length (what an answer call costs Ray, without answering)."""

    def run(self, x) -> int:
        return len(x)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import ray

    ray.init(include_dashboard=False, logging_level="WARNING")
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    actors = [ray.remote(num_cpus=1)(Echo).remote() for _ in range(args.workers)]
    ray.get([a.run.remote("") for a in actors])
    start_s = time.perf_counter() - t0
    example = {"question": "who got the first nobel prize in physics",
               "passages": [{"title": "t", "text": "x" * 700}] * 10}

    def median_call(payload) -> float:
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            ray.get(actors[0].run.remote(payload))
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    empty_s, example_s = median_call(""), median_call(example)
    ray.shutdown()
    print(f"ray.init (local, no dashboard): {init_s:.2f} s")
    print(f"{args.workers} empty actors started: {start_s:.2f} s")
    print(f"one call, median of {args.calls}: {1000 * empty_s:.2f} ms empty, {1000 * example_s:.2f} ms with a "
          "10-passage example")


if __name__ == "__main__":
    main()
