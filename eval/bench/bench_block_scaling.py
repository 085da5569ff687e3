"""APE's attention scaling over reused blocks, fitted without labels: how close block attention's
next-token distributions come to full attention's for each (temperature, scale) of a grid.

For --n NQ-open multi-doc prompts (10 passages, the gold passage at 1, 5 or 10 in turn; questions from
the end of the seeded order, so none of `bench_recompute`'s first questions), full attention answers
greedily for --new-tokens tokens; block attention (stored passage blocks, no recompute) is then
teacher-forced on the same tokens with `block_attention.ScaledKV` applying each `BlockScaling` of the grid
to the question's and the answer's attention to passage tokens. Per grid point: the mean KL(full || block)
over those positions and how often the two agree on the most likely token. (1, 1) is plain block
attention; a point below its KL is what APE would fit (Yang et al., ICLR 2025, sec. 4).

--layouts picks where the blocks sit: "sequential" (block mode's layout: each passage re-encoded by RoPE
to its place in the prompt, the question after the last) or "parallel" (APE's layout, sec. 3: every
passage at the positions it was encoded at, right after the shared prefix, none re-encoded, and the
question right after the longest passage, so each passage is as near the question as if it were the
only one); every grid point is measured in each.

    OMP_NUM_THREADS=1 python -m ldqa.eval.bench.bench_block_scaling --model gemma3-270m --n 9 \\
        --temperatures 1.0,1.1,1.25 --scales 0.25,0.5,0.75,1 --out out/block-scaling-gemma
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from ldqa.eval.nq import DEFAULT_DATA, load_nq, multidoc_example

POSITIONS = (1, 5, 10)


def _floats(text: str, name: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{name} {text!r}: give comma-separated numbers") from None
    if any(x <= 0 for x in out):
        raise SystemExit(f"{name} {text!r}: every value must be > 0")
    return out


def kl_agreement(lp_ref, lp) -> tuple[float, float]:
    """(mean KL(ref || other) in nats, the share of positions whose most likely token agrees) of two
    (positions, vocab) log-probability tensors."""
    kl = float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())
    return kl, float((lp.argmax(-1) == lp_ref.argmax(-1)).float().mean())


LAYOUTS = ("sequential", "parallel")


def parallel_blocks(rt, seg):
    """APE's parallel layout of `seg`'s passages (module docstring): the cache [prefix][h1 b1]...[hk bk]
    with passage i's header and body at positions P..P+len(h_i)+len(b_i)-1 (P: the prefix's length), the
    stored blocks as encoded (a body rotated by its header's length only). Returns (cache, the first
    position after the longest passage)."""
    import torch

    from ldqa.attention.block_attention import PrefillStats, reencode_keys_

    prefix, stats = seg.prefix, PrefillStats(mode="block")
    p = len(prefix)
    cache = rt.model.new_cache(capacity=len(seg) + 64)
    pk, pv = rt.prefix_block(prefix)
    cache.extend(pk, pv, torch.arange(p))
    top = p
    for header, body in zip(seg.headers, seg.passages):
        hk, hv = rt.header_block(prefix, header)
        cache.extend(hk, hv, torch.arange(p, p + len(header)))
        k, v = rt.get_block(prefix, body, None, stats)
        reencode_keys_(rt.model, k, len(header))
        end = p + len(header) + len(body)
        cache.extend(k, v, torch.arange(p + len(header), end))
        top = max(top, end)
    return cache, top


def kl_grid(qa, examples, grid, new_tokens: int, layouts=("sequential",)) -> dict:
    """{(layout, temperature, scale): [(KL, top-1 agreement) per example]} over `examples` (dicts of
    multidoc_example), see the module docstring."""
    import torch

    from ldqa.app.api import Passage, _build_prompt
    from ldqa.attention.block_attention import BlockScaling, ScaledKV

    model, tok = qa.llm.model, qa.llm.tokenizer
    chat = qa.chat_format(None)
    rt = qa.engine.block_runtime
    out = {(lay, t, s): [] for lay in layouts for t, s in grid}
    m = new_tokens
    for ex in examples:
        ps = [Passage(p["title"], p["text"]) for p in ex["passages"]]
        seg = _build_prompt(tok, ps, ex["question"], SimpleNamespace(instruction=None, answer_prefix=None), chat)
        ids = seg.ids()
        with torch.no_grad():
            cache = model.new_cache(capacity=len(ids) + m + 8)
            logits = model(torch.tensor([ids]), torch.arange(len(ids)), cache)
            ys = []
            for _ in range(m):  # full attention's greedy answer
                ys.append(int(logits[0, -1].argmax()))
                logits = model(torch.tensor([[ys[-1]]]), torch.tensor([cache.length]), cache)
            cache = model.new_cache(capacity=len(ids) + m + 8)
            model(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1), cache)
            full = model(torch.tensor([[ids[-1]] + ys[:-1]]), torch.arange(len(ids) - 1, len(ids) - 1 + m), cache,
                         all_logits=True)[0]
            lp_full = torch.log_softmax(full.float(), -1)  # (m, vocab)
            q = seg.question
            for lay in layouts:
                if lay == "parallel":
                    blocks, at = parallel_blocks(rt, seg)
                else:
                    blocks, _ = rt.assemble(seg, [None] * len(ps), mode="block")
                    at = blocks.length
                start, end = len(seg.prefix), blocks.length  # the passages' slots
                for t, s in grid:
                    c = blocks.clone()
                    c.policy = ScaledKV(BlockScaling(t, s), start, end, at, model.cfg.attn_scale)
                    got = model(torch.tensor([q + ys[:-1]]), torch.arange(at, at + len(q) + m - 1), c,
                                all_logits=True)[0, -m:]
                    out[(lay, t, s)].append(kl_agreement(lp_full, torch.log_softmax(got.float(), -1)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=9, help="prompts (gold at 1, 5, 10 in turn)")
    ap.add_argument("--temperatures", default="0.9,1.0,1.1")
    ap.add_argument("--scales", default="0.5,1,2")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--layouts", default="sequential", help="comma-separated: sequential, parallel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("out/bench-block-scaling"))
    args = ap.parse_args(argv)
    grid = [(t, s) for t in _floats(args.temperatures, "--temperatures") for s in _floats(args.scales, "--scales")]
    if (1.0, 1.0) not in grid:
        grid.append((1.0, 1.0))  # plain block attention, the reference
    if not args.data.exists():
        raise SystemExit(f"--data {args.data}: not found (the NQ-open oracle file of ../shared/data)")
    layouts = args.layouts.split(",")
    if not layouts or any(x not in LAYOUTS for x in layouts):
        raise SystemExit(f"--layouts {args.layouts!r}: give comma-separated {', '.join(LAYOUTS)}")
    if args.n < 1 or args.new_tokens < 1:
        raise SystemExit("--n and --new-tokens must be >= 1")

    from ldqa.app.api import LongDocQA

    records = load_nq(args.data)
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    examples = [multidoc_example(records, i, 10, POSITIONS[j % 3], args.seed)
                for j, i in enumerate(order[-args.n:])]
    args.out.mkdir(parents=True, exist_ok=True)
    store = tempfile.TemporaryDirectory(prefix="kv-", dir=args.out)  # the passages' blocks, removed on return
    qa = LongDocQA(store=Path(store.name), model=args.model)
    res = kl_grid(qa, examples, grid, args.new_tokens, layouts)
    rows = sorted(({"layout": lay, "temperature": t, "scale": s, "kl": sum(k for k, _ in v) / len(v),
                    "kl_by_gold": [sum(k for k, _ in v[j::3]) / len(v[j::3]) for j in range(min(3, len(v)))],
                    "top1_agreement": sum(a for _, a in v) / len(v)} for (lay, t, s), v in res.items()),
                  key=lambda r: r["kl"])
    plain = next(r for r in rows if (r["layout"], r["temperature"], r["scale"]) == (layouts[0], 1.0, 1.0))
    result = {"model": qa.model_name, "weights": qa.weights, "n": args.n, "new_tokens": args.new_tokens,
              "layouts": layouts, "grid": rows, "best": rows[0], "plain_block": plain}
    (args.out / "bench-block-scaling.json").write_text(json.dumps(result, indent=1))
    print("| layout | temperature | scale | KL(full || block) | KL gold 1 / 5 / 10 | top-1 agreement |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        by = " / ".join(f"{x:.3f}" for x in r["kl_by_gold"])
        print(f"| {r['layout']} | {r['temperature']:g} | {r['scale']:g} | {r['kl']:.4f} | {by} | "
              f"{r['top1_agreement']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
