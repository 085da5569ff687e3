"""The examples of each benchmark (`BUILDERS[benchmark](cfg, qa)` -> example dicts): NQ-open multi-document,
key-value retrieval, needle in a haystack, retrieval over the oracle corpus and JSON-lines records; the
protocols are described in `ldqa.eval.harness`."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from ldqa.eval.answering import write_context
from ldqa.eval.config import DEFAULT_MAX_NEW, EvalConfig, NIAH_DEFAULT, _ints, gold_positions, parse_modes

def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _sample(n: int, cfg: EvalConfig) -> list[int]:
    """The first `limit` of a seeded permutation of range(n) but the first `skip`: a larger limit extends a
    smaller one."""
    order = list(range(n))
    random.Random(cfg.seed).shuffle(order)
    return (order[: cfg.limit] if cfg.limit else order)[cfg.skip:]


def split_tokens(tok, ids: list[int], size: int, keep: tuple[int, int] = (0, 0)) -> list[str]:
    """Decode `ids` as texts of about `size` tokens; no boundary falls inside the span `keep`."""
    cuts = [keep[1] if keep[0] < b < keep[1] else b for b in range(size, len(ids), size)]
    cuts = sorted({c for c in cuts if 0 < c < len(ids)})
    texts = [tok.decode(ids[a:b]) for a, b in zip([0] + cuts, cuts + [len(ids)])]
    return [t for t in texts if t.strip()]


def _nq_multidoc(cfg: EvalConfig, qa) -> list[dict]:
    from ldqa.eval.nq import load_nq, multidoc_example

    records = load_nq(Path(cfg.data))
    if cfg.n_passages > len(records):
        raise ValueError(f"--n-passages {cfg.n_passages} exceeds the {len(records)} records of {cfg.data}")
    out = []
    for i in _sample(len(records), cfg):
        for p in gold_positions(cfg.gold_positions, cfg.n_passages):
            ex = multidoc_example(records, i, cfg.n_passages, p, cfg.seed)
            out.append(ex | {"id": f"q{i}/pos{p}", "record": i})
    return out


# The key-value task's instruction, as in Liu et al. 2023 (section 3.1), and the start of the answer: the
# study's prompt ends in 'Corresponding value: "', so the model's first token is the value's; with ldqa's
# QA prompt alone ('Question: ...\nAnswer:') Gemma 3 270M (base) answers 'The value of key "..." in the
# JSON data is 1.' every time (0 of 100, see docs/results.md), which measures nothing.
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
KV_ANSWER_PREFIX = 'The value of key "{key}" is "'


def _kv(cfg: EvalConfig, qa) -> list[dict]:
    rows = _read_jsonl(Path(cfg.data))
    out = []
    for i in _sample(len(rows), cfg):
        r = rows[i]
        others = [tuple(p) for p in r["ordered_kv_records"] if p[0] != r["key"]]
        if cfg.kv_keys:
            others = others[: max(0, cfg.kv_keys - 1)]
        for d in _ints(cfg.depths, "--depths"):
            pos = round(d / 100 * len(others))
            recs = others[:pos] + [(r["key"], r["value"])] + others[pos:]
            data = "{" + ", ".join(f'"{k}": "{v}"' for k, v in recs) + "}"
            out.append({"id": f"{i}/depth{d}", "record": i, "depth": d, "position": pos + 1,
                        "n_records": len(recs), "question": f'What is the value of key "{r["key"]}" in the JSON data?',
                        "answers": [r["value"]], "passages": [{"title": "JSON data", "text": data}],
                        "instruction": KV_INSTRUCTION, "answer_prefix": KV_ANSWER_PREFIX.format(key=r["key"])})
    return out


def _haystack(path: Path, tok, n_tokens: int) -> list[int]:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"--data {path}: no .txt files for the niah haystack")
    text = ""
    for f in files:  # read only what the longest context needs (about 4 characters a token; margin 2x)
        text += f.read_text(encoding="utf-8", errors="replace") + "\n\n"
        if len(text) > 8 * n_tokens:
            break
    ids = tok.encode(text)
    if len(ids) < n_tokens:
        raise ValueError(f"--lengths {n_tokens}: the haystack in {path} has only {len(ids)} tokens")
    return ids


def _niah(cfg: EvalConfig, qa) -> list[dict]:
    conf = dict(NIAH_DEFAULT)
    if cfg.niah_config:
        conf |= json.loads(Path(cfg.niah_config).read_text())
    answers = conf.get("answers") or [conf["answer"]]
    tok = qa.llm.tokenizer
    lengths, depths = _ints(cfg.lengths, "--lengths"), _ints(cfg.depths, "--depths")
    hay_ids = _haystack(Path(cfg.data), tok, max(lengths))
    needle = tok.encode(" " + conf["needle"].strip() + " ")
    cells = [(n, d) for n in lengths for d in depths][: cfg.limit][cfg.skip:]
    out = []
    for n, d in cells:
        hay = hay_ids[: max(0, n - len(needle))]
        at = round(d / 100 * len(hay))
        ids = hay[:at] + needle + hay[at:]
        texts = split_tokens(tok, ids, cfg.passage_tokens, keep=(at, at + len(needle)))
        out.append({"id": f"len{n}/depth{d}", "length": n, "depth": d, "question": conf["question"],
                    "answers": answers, "passages": [{"title": "Essays", "text": t} for t in texts]})
    return out


def _jsonl(cfg: EvalConfig, qa) -> list[dict]:
    """The jsonl benchmark's examples. For modes without a retriever (the whole-context path) a
    ``context`` is split into passages of --passage-tokens (cut in its middle to fit --max-length when
    given); for modes with one (`answering.answer_from_collection`) the context is written to its collection
    directory (`write_context`) and the example carries its ``context_sha256``. Raises ValueError naming
    the record when it lacks a question or answers, or, with a retriever, a ``context`` string."""
    modes = parse_modes(cfg.modes, cfg.debias, cfg.retriever, cfg.benchmark)
    whole, collections = any(not m.collection for m in modes), any(m.collection for m in modes)
    rows = _read_jsonl(Path(cfg.data))
    out = []
    for i in _sample(len(rows), cfg):
        r = rows[i]
        question = r.get("question") or r.get("input")
        answers = r.get("answers") if r.get("answers") is not None else r.get("answer")
        answers = [answers] if isinstance(answers, str) else list(answers or [])
        if not question or not answers:
            raise ValueError(f"--data {cfg.data}, record {i + 1}: needs a question (or input) and answers")
        if collections and not (isinstance(r.get("context"), str) and r["context"].strip()):
            raise ValueError(f"--data {cfg.data}, record {i + 1}: --retriever indexes each record's context, and "
                             "this record has no context string (passages records: drop --retriever)")
        skip, cut, passages = None, 0, None
        if r.get("passages"):
            passages = [p if isinstance(p, dict) else {"title": f"Passage {j + 1}", "text": p}
                        for j, p in enumerate(r["passages"])]
        elif r.get("context"):
            if whole:
                tok = qa.llm.tokenizer
                texts, cut = split_tokens(tok, tok.encode(r["context"]), cfg.passage_tokens), 0
                if cfg.max_length is not None:
                    try:
                        texts, cut = fit_context(tok, r["context"], question, cfg.passage_tokens,
                                                 cfg.max_length - (cfg.max_new_tokens or DEFAULT_MAX_NEW["jsonl"]),
                                                 qa.chat_format())
                    except ValueError as e:  # this record's question cannot fit: an error row, the rest go on
                        skip = str(e)
                passages = [{"title": "Context", "text": t} for t in texts]
        else:
            raise ValueError(f"--data {cfg.data}, record {i + 1}: needs context or passages")
        ex_id = str(r.get("_id") or r.get("id") or f"line{i + 1}")
        out.append({"id": ex_id, "record": i, "question": question, "answers": answers, "passages": passages,
                    **({"length": r["length"]} if "length" in r else {}),
                    **({"context_tokens_cut": cut} if cfg.max_length is not None and whole else {}),
                    **({"skip_reason": skip} if skip else {}),
                    **({"context_sha256": write_context(qa, r["context"], cfg)} if collections else {})})
    return out


def fit_context(tok, context: str, question: str, passage_tokens: int, budget: int,
                chat=None) -> tuple[list[str], int]:
    """Passages of a long `context` whose prompt (`build_prompt`, default instruction, the model's `chat`
    format or None) is at most `budget` tokens, cutting the context's middle as LongBench does
    (`prompt.truncate_middle`). Returns (passage texts, context tokens cut). Raises ValueError when even an
    empty context does not fit `budget`."""
    from types import SimpleNamespace

    from ldqa.app.prompt import build_prompt, truncate_middle

    ids = tok.encode(context)
    n_ctx = len(ids)
    base = len(build_prompt(tok, [], question, chat=chat).ids())  # instruction + question, no passage
    if base >= budget:
        raise ValueError(f"--max-length: the question alone takes {base} prompt tokens, over the budget of "
                         f"{budget} (max length minus the answer budget); raise --max-length")
    for _ in range(8):  # decoding and re-encoding the pieces may shift the count by a few tokens
        texts = split_tokens(tok, ids, passage_tokens)
        n = len(build_prompt(tok, [SimpleNamespace(title="Context", text=t, page=None) for t in texts],
                             question, chat=chat).ids())
        if n <= budget:
            return texts, n_ctx - len(ids)
        frame = max(0.0, (n - base - len(ids)) / max(1, len(texts)))  # tokens each piece's framing adds
        keep = int((budget - base) / (1 + frame / passage_tokens) - frame) - 1
        keep = min(keep, len(ids) - 1)
        if keep < 2:
            raise ValueError(f"--max-length: the question leaves {budget - base} prompt tokens, too few for "
                             f"any of the context; raise --max-length")
        ids = truncate_middle(ids, keep)
    raise ValueError(f"--max-length: could not fit the context into {budget} prompt tokens")


def _retrieval(cfg: EvalConfig, qa) -> list[dict]:
    from ldqa.eval.nq import load_nq

    records = load_nq(Path(cfg.data))
    folder = qa.store.path.parent / "passages"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, r in enumerate(records):  # one Markdown document per gold passage (as eval/bench/bench_nq.py)
        p = folder / f"{i:05d}.md"
        body = f"# {r['title']}\n\n{r['text']}\n"
        if not p.exists() or p.read_text(encoding="utf-8") != body:
            p.write_text(body, encoding="utf-8")
        paths.append(p)
    report = qa.ingest(paths, progress=cfg.progress)  # unchanged files are skipped on a rerun
    doc_of = [f.doc_id for f in report.files]  # duplicates carry the stored copy's id
    return [{"id": f"q{i}", "record": i, "question": records[i]["question"], "answers": records[i]["answers"],
             "gold_doc": doc_of[i], "passages": None} for i in _sample(len(records), cfg)]


BUILDERS = {"nq-multidoc": _nq_multidoc, "kv-retrieval": _kv, "niah": _niah, "retrieval": _retrieval,
            "jsonl": _jsonl}
