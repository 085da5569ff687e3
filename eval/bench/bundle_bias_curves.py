"""Write the bias curves ldqa ships (`ldqa.attention.bias_curve.BUNDLED`), so a new user's first debiased
question does not spend its estimate (10-60 s for Gemma 3 270M, 2.5-4 minutes for Qwen2.5 1.5B at k = 5 on
this 2-core machine): the default model in its default weights at the default top_k, full attention and
block attention (whose default debiasing, `calibrate+reorder`, reads one; its blocks after the default
anchor passages), and Gemma 3 270M at k = 1..10.

    python -m ldqa.eval.bench.bundle_bias_curves --modes block,full --k 5       # the default model
    python -m ldqa.eval.bench.bundle_bias_curves --model gemma3-270m --modes full,block --k 1-10

Each curve is `LongDocQA.bias_curve` (found-in-the-middle calibration on the bundled sample, the same
computation a user's machine would do; taken from this machine's cache when there) and is stored under
its cache file's name, which holds the model fingerprint (source sha256 + weight format) and the prompt
layout (`-chat` for a chat template): a curve is only ever used for the exact weights and layout it was
measured on. Entries already in the file are kept (rerun with other options to add more); the file is
rewritten atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from ldqa.attention.bias_curve import BUNDLED
from ldqa.attention.block_attention import anchor_passages_of

ABOUT = ("position-only attention bias curves (found-in-the-middle calibration) of ldqa's packaged models, by cache "
         "file name: the default model at the default top_k, Gemma 3 270M at k = 1..10; written by python -m "
         "ldqa.eval.bench.bundle_bias_curves")


def parse_ks(spec: str) -> list[int]:
    """'1-10' or '1,2,5' -> sorted k values (each >= 1). Raises ValueError naming the spec."""
    ks = set()
    try:
        for part in spec.split(","):
            a, _, b = part.partition("-")
            ks |= set(range(int(a), int(b or a) + 1))
    except ValueError:
        raise ValueError(f"--k {spec!r}: give numbers and ranges like 1-10 or 1,2,5") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--k {spec!r}: passage counts are >= 1")
    return sorted(ks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: ldqa's default model")
    ap.add_argument("--weights", default=None, help="default: ldqa's default weight format")
    ap.add_argument("--modes", default="full", help="comma-separated attention modes (full, block, block+recompute)")
    ap.add_argument("--k", default="1-10", help="passage counts, e.g. 1-10 or 1,5")
    ap.add_argument("--out", default=str(BUNDLED))
    args = ap.parse_args(argv)
    from ldqa.app.api import LongDocQA

    ks = parse_ks(args.k)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    curves, made = data.get("curves", {}), data.get("made_with", {})
    with tempfile.TemporaryDirectory() as tmp:
        qa = LongDocQA(store=tmp, model=args.model, weights=args.weights)
        qa.warm_up()
        for mode in args.modes.split(","):
            for k in ks:
                t0 = time.perf_counter()
                name = qa.engine.bias_curve_path(k, mode).stem
                curves[name] = qa.bias_curve(k, mode).tolist()
                made[name] = {"model": qa.model_name, "weights": qa.weights, "attention": mode, "k": k,
                              "n_examples": 16, "seed": 0}
                anchor = anchor_passages_of(mode)
                if anchor:  # block modes' blocks encoded after their default anchor passages
                    made[name]["anchor_passages"] = anchor
                print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        qa.store.close()
        qa.kv_store.close()
    data = {"about": ABOUT,
            "curves": dict(sorted(curves.items())), "made_with": dict(sorted(made.items()))}
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(data, indent=1) + "\n")
    tmp_out.replace(out)
    print(f"{len(curves)} curves in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
