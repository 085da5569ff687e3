"""An eval run's results: per-mode summaries (`summarize`), the markdown table (`summary_markdown`), the
JSON/CSV files (`write_outputs`) and the plots (`plot`)."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from ldqa.eval.answering import RANK_KS
from ldqa.eval.config import JSONL_COLLECTION_COLUMNS

def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict], benchmark: str) -> dict:
    """One mode's summary: n, accuracy (mean score), median TTFT / tokens/s (tokens/s over answers of
    two tokens or more) / prompt tokens, peak memory, and the benchmark's breakdown."""
    s = {"n": len(rows), "accuracy": _mean(r["score"] for r in rows),
         "ttft_ms": _median(r["ttft_ms"] for r in rows),
         "tokens_per_s": _median(r["tokens_per_s"] for r in rows if r["tokens_per_s"]),
         "prompt_tokens": _median(r["prompt_tokens"] for r in rows),
         "peak_mb": max((r["peak_mb"] for r in rows), default=None),
         "fallbacks": sum(r["attention_used"] != r["mode"].split("/")[0].split("@")[0] for r in rows)}
    if benchmark == "retrieval":
        s |= {k: _mean(r[k] for r in rows) for k in [f"recall@{k}" for k in RANK_KS] + ["mrr@10", "ndcg@10"]}
    if benchmark == "jsonl" and any("gold_in_retrieved" in r for r in rows):  # over per-record collections
        s |= {"gold_in_retrieved": _mean(r["gold_in_retrieved"] for r in rows),
              **{k: _median(r[k] for r in rows) for k in ("retrieval_ms", "ttft_cold_ms", "ttft_warm_ms")},
              "abstained": sum(bool(r.get("abstained")) for r in rows)}
    key = {"nq-multidoc": "gold_position", "kv-retrieval": "depth"}.get(benchmark)
    if key:
        s["by_position"] = {str(p): _mean(r["score"] for r in rows if r[key] == p)
                            for p in sorted({r[key] for r in rows})}
    if benchmark == "niah":
        s["grid"] = {f"{r['length']}@{r['depth']}": r["score"] for r in rows}
    return s


def _fmt(x, digits=1) -> str:
    return "" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def summary_markdown(result: dict) -> str:
    """The summary table (one line per mode) plus, where it applies, accuracy by gold position/depth."""
    bench, modes = result["benchmark"], result["modes"]
    st = result["settings"]
    head = ["mode", "n", "accuracy", "TTFT ms (median)", "tokens/s (median)", "peak RSS MB", "prompt tokens (median)"]
    extra = [f"recall@{k}" for k in RANK_KS] + ["mrr@10", "ndcg@10"] if bench == "retrieval" else []
    if bench == "jsonl" and any("gold_in_retrieved" in m for m in modes):
        extra = JSONL_COLLECTION_COLUMNS
    lines = [f"# ldqa eval {bench}", "",
             f"model `{result['model']}`, data `{st['data']}`, seed {st['seed']}, max_new_tokens "
             f"{st['max_new_tokens']}; accuracy = {result['metric']}; answers computed: {result['computed']}, "
             f"from the cache: {result['cached']}.", "",
             "| " + " | ".join(head + extra) + " |", "|" + "---|" * len(head + extra)]
    for m in modes:
        cells = [m["mode"], str(m["n"]), _fmt(m["accuracy"], 3), _fmt(m["ttft_ms"]), _fmt(m["tokens_per_s"]),
                 _fmt(m["peak_mb"], 0), _fmt(m["prompt_tokens"], 0)] + [_fmt(m.get(k), 1 if k.endswith("_ms") else 3) for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    if extra == JSONL_COLLECTION_COLUMNS:
        lines += ["", "Modes with a retriever answer each record over its own collection (top "
                  f"{st['top_k']} chunks, as `ldqa ask`): TTFT ms (median) is the cold one, the first question "
                  "over the freshly built collection; ttft_warm_ms the same question again with its KV blocks "
                  "stored; gold_in_retrieved the fraction whose retrieved chunks hold a gold answer."]
    if any(m.get("fallbacks") for m in modes):
        lines += ["", "Some block-mode answers fell back to full attention (see `attention_used` in results.csv)."]
    if "by_position" in modes[0]:
        pos = list(modes[0]["by_position"])
        what = "gold position" if bench == "nq-multidoc" else "key depth %"
        lines += ["", f"Accuracy by {what}:", "", "| mode | " + " | ".join(pos) + " |", "|" + "---|" * (len(pos) + 1)]
        lines += ["| " + m["mode"] + " | " + " | ".join(_fmt(m["by_position"].get(p), 3) for p in pos) + " |"
                  for m in modes]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path) -> None:
    """results.json, results.csv, summary.md and the plots."""
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    cols = list(dict.fromkeys(k for r in result["rows"] for k in r))
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in result["rows"]:
            w.writerow({k: " | ".join(v) if isinstance(v, list) else v for k, v in r.items()})
    (out / "summary.md").write_text(summary_markdown(result))
    plot(result, out)


def plot(result: dict, out: Path) -> list[Path]:
    """ttft_vs_length.png always; accuracy_vs_position.png (nq-multidoc, kv-retrieval); niah_heatmap.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made, modes, rows = [], [m["mode"] for m in result["modes"]], result["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in modes:
        by_len: dict[int, list] = {}
        for r in rows:
            if r["mode"] == m and r["ttft_ms"] is not None:
                by_len.setdefault(r["prompt_tokens"], []).append(r["ttft_ms"])
        xs = sorted(by_len)
        ax.plot(xs, [statistics.median(by_len[x]) for x in xs], "o-", label=m, alpha=0.7)
    ax.set(xlabel="prompt tokens", ylabel="TTFT (ms, median)", title=f"{result['benchmark']}: TTFT vs context length")
    ax.legend(fontsize=7)
    made.append(_save(fig, out / "ttft_vs_length.png"))
    if "by_position" in result["modes"][0]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m in result["modes"]:
            ax.plot([int(p) for p in m["by_position"]], list(m["by_position"].values()), "o-", label=m["mode"])
        xl = "gold passage position" if result["benchmark"] == "nq-multidoc" else "key depth (%)"
        ax.set(xlabel=xl, ylabel="accuracy", ylim=(-0.05, 1.05), title=f"{result['benchmark']}: accuracy vs position")
        ax.legend(fontsize=7)
        made.append(_save(fig, out / "accuracy_vs_position.png"))
    if result["benchmark"] == "niah":
        lengths = sorted({r["length"] for r in rows})
        depths = sorted({r["depth"] for r in rows})
        fig, axes = plt.subplots(1, len(modes), figsize=(3.2 * len(modes) + 1, 3.2), squeeze=False)
        for ax, m in zip(axes[0], result["modes"]):
            grid = [[m["grid"].get(f"{n}@{d}", float("nan")) for n in lengths] for d in depths]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i, line in enumerate(grid):
                for j, v in enumerate(line):
                    ax.text(j, i, "" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
            ax.set(title=m["mode"], xlabel="context tokens", ylabel="needle depth")
        made.append(_save(fig, out / "niah_heatmap.png"))
    return made


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
