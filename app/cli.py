"""`ldqa` command line: ingest, ask, demo.

    ldqa ingest PATH... [--store DIR] [--chunk-tokens N] [--ray [ADDRESS] --workers N]
    ldqa ask "question" [--store DIR] [--top-k K] [--retriever hybrid|dense|bm25] [--model M] [--json]
    ldqa ask - < question.txt   or   ldqa ask --question-file question.txt
    ldqa demo [--store DIR]     # ingest the bundled sample, answer its questions
    ldqa eval BENCHMARK --data PATH --modes full,block,hf [--limit N] [--seed S] [--out DIR]  # see ldqa.eval.harness
    ldqa serve [--store DIR] [--auth-file F] [--shared-store DIR]   # the web app (see ldqa.app.ui)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ldqa.app.render import answer_facts

SAMPLE_DIR = Path(__file__).parent / "sample"


def _common(p: argparse.ArgumentParser, store_help: str | None = None) -> None:
    p.add_argument("--store", help=store_help or "collection directory (default: the user's data dir, "
                                                 "ldqa/stores/default)")
    from ldqa.app.options import add_model_arguments

    add_model_arguments(p)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the bad flag and why, then where the flags are listed (not the whole
    usage first, which buries the line that matters)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ldqa", description="Long-document question answering with citations.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("ingest", help="add files or directories (.txt .md .pdf .html) to the collection",
                       epilog="Exit status: 0 when every file was added, replaced or skipped (unchanged since "
                              "it was stored); 1 when a file failed (each is named with its reason; the others "
                              "are stored); 2 on a bad option or store.")
    _common(p)
    p.add_argument("paths", nargs="+")
    p.add_argument("--chunk-tokens", type=int, default=256, help="chunk size in LLM tokens (default 256)")
    p.add_argument("--overlap-tokens", type=int, default=32, help="overlap between chunks (default 32)")
    p.add_argument("--index", choices=["flat", "hnsw"], default=None,
                   help="dense index: flat (exact, default for new stores) or hnsw (approximate)")
    p.add_argument("--json", action="store_true", help="print the IngestReport as JSON")
    from ldqa.app import options
    from ldqa.app.api import precompute_kv_by_default

    p.add_argument("--precompute-kv", action=argparse.BooleanOptionalAction, default=precompute_kv_by_default(),
                   help="also encode and store every new chunk's KV block, so the first question over it is warm "
                        "in block modes (default: "
                        + ("on, the default attention is a block mode" if precompute_kv_by_default()
                           else "off, the default attention is full")
                        + "; it prints the seconds and MB of disk per 1K tokens)")
    block_default = options.default("attention") if precompute_kv_by_default() else "block"
    p.add_argument("--precompute-attention", choices=("block", "block+recompute"), default=block_default,
                   help=f"the block mode whose KV blocks --precompute-kv stores (default: {block_default}; the two "
                        "modes encode their blocks after different anchor passages, see --anchor-passages)")
    from ldqa.app.ray_workers import add_arguments as add_ray_arguments

    add_ray_arguments(p)

    for name, help_ in (("ask", "answer a question from the collection"),
                        ("demo", "ingest the bundled sample and answer its questions")):
        p = sub.add_parser(name, help=help_)
        _common(p, "collection directory (default: a temporary one, removed when the demo ends)" if name == "demo"
                else None)
        if name == "ask":
            p.add_argument("question", nargs="?", default=None,
                           help='the question; "-" reads it from standard input (for one over a shell\'s '
                                'argument limit, or use --question-file)')
            p.add_argument("--question-file", default=None, metavar="FILE",
                           help="read the question from this UTF-8 text file instead of the command line")
        options.add_arguments(p, name)  # every answering option of `AnswerOptions` this command has
        if name == "demo":
            p.add_argument("--no-compare", action="store_true",
                           help="skip answering the questions again with full attention and no debiasing "
                                "(printed side by side with the chosen setting's answers)")
        if name == "ask":
            p.add_argument("--save-settings", action="store_true",
                           help="keep --max-new-tokens with the collection: later asks and the web app start from it")
        p.add_argument("--json", action="store_true", help="print the whole Answer as one JSON object")

    from ldqa.eval.harness import BENCHMARKS, add_arguments

    p = sub.add_parser("eval", help=f"batch evaluation: {', '.join(BENCHMARKS)}; modes compared in one table")
    add_arguments(p)

    p = sub.add_parser("serve", help="the web app: upload documents, ask, read the cited passages",
                       description="The web app (docs/web-app.md). Without login, every browser session uses the "
                                   "one collection in --store. With login (--auth-file, or LDQA_UI_USER and "
                                   "LDQA_UI_PASSWORD), each user has a private collection in STORE/users/NAME "
                                   "and searches the shared collection STORE/shared with it, read-only; a "
                                   "store that held a single collection has its documents moved to "
                                   "STORE/shared the first time it is served with login.")
    _common(p, "the served store (default: the user's data dir, ldqa/stores/default): the collection, or with login "
               "the directory of every user's collection and the shared one")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--concurrency", type=int, default=2, help="requests served at once (default 2)")
    p.add_argument("--max-upload-mb", type=float, default=50.0, help="largest accepted upload (default 50 MB)")
    p.add_argument(options.flag("max_new_tokens"), type=options.parse_value("max_new_tokens"), default=None,
                   help="default answer cap in tokens (default: the collection's saved setting, else 64)")
    p.add_argument("--auth-file", default=None,
                   help="file of user:password lines for a login page (or set LDQA_UI_USER and LDQA_UI_PASSWORD); "
                        "each user then has a private collection")
    p.add_argument("--shared-store", default=None, metavar="DIR",
                   help="a collection every session also searches, read-only in the web app (fill it with "
                        "ldqa ingest FILES --store DIR)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="ldqa: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return {"ingest": cmd_ingest, "ask": cmd_ask, "demo": cmd_demo, "eval": cmd_eval,
                "serve": cmd_serve}[args.cmd](args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"ldqa {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def _qa(args, **kw):
    from ldqa.app.api import LongDocQA

    return LongDocQA(store=args.store, model=args.model, weights=args.weights, kv_dtype=args.kv_dtype,
                     device=args.device, chat_template=args.chat_template, **kw)


def cmd_ingest(args) -> int:
    import contextlib

    from ldqa.app import ray_workers

    ray_workers.check_options(args.ray, args.workers, args.threads_per_worker)
    qa = _qa(args, chunk_tokens=args.chunk_tokens, overlap_tokens=args.overlap_tokens, index=args.index)
    on_ray = dict(ray=args.ray, workers=args.workers, threads_per_worker=args.threads_per_worker)
    with ray_workers.connected(args.ray) if args.ray else contextlib.nullcontext():  # one Ray session for both
        report = qa.ingest(args.paths, progress=not args.json, **on_ray)
        if args.precompute_kv:
            new_docs = [f.doc_id for f in report.files if f.status in ("added", "replaced")]
            kv = qa.precompute_kv(new_docs, progress=not args.json, attention=args.precompute_attention, **on_ray)
            if not args.json:
                print("KV blocks: " + precompute_line(kv))
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
        for f in report.errors:  # standard output holds the JSON: name the failures beside it
            print(f"ldqa ingest: {f.path}: {f.reason}", file=sys.stderr)
    else:
        for f in report.files:
            extra = (f.reason if f.status == "error" else
                     _count(f.chunks, "chunk") + (", unchanged since it was stored" if f.status == "skipped" else ""))
            print(f"{f.status:9s} {f.path}  ({extra})")
        print(f"{report.added} added/replaced, {report.skipped} skipped, {_count(len(report.errors), 'error')}, "
              f"{_count(report.chunks, 'chunk')} in {report.ms / 1000:.1f} s; store {qa.store.path}")
    return 1 if report.errors else 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def precompute_line(kv: dict) -> str:
    """What `LongDocQA.precompute_kv`'s result `kv` says, in one line: the blocks, those computed, their
    tokens, time and disk, and per 1K tokens computed the seconds and MB of disk (when any were computed)."""
    s = kv["ms"] / 1000
    line = (f"{kv['blocks']} ({kv['computed']} computed, {kv['tokens']:,} tokens, {kv['bytes'] / 1e6:.1f} MB) "
            f"in {s:.1f} s")
    if kv["tokens"]:
        k = kv["tokens"] / 1000
        line += f"; per 1K tokens {s / k:.1f} s and {kv['bytes'] / 1e6 / k:.1f} MB of disk"
    return line


def read_question(args, stdin=None) -> str:
    """The question of `ldqa ask`: its argument, standard input (`stdin`, default sys.stdin) for "-", or
    the text of --question-file (both read whole, surrounding whitespace stripped). Raises ValueError when
    there is no question or two are given, or when the file cannot be read as UTF-8 text (naming it)."""
    if args.question_file is not None:
        if args.question is not None:
            raise ValueError("give the question either as an argument or with --question-file, not both")
        try:
            return Path(args.question_file).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--question-file {args.question_file} cannot be read ({e}): give a UTF-8 text "
                             "file holding the question") from e
    if args.question is None:
        raise ValueError('no question: give it as an argument (ldqa ask "What is ...?"), "-" to read it from '
                         "standard input, or --question-file FILE")
    if args.question == "-":
        return (stdin or sys.stdin).read().strip()
    return args.question


def check_collection(store: str | None) -> None:
    """Raise ValueError unless `store` (None: the default collection) holds a collection, so that asking
    a mistyped store neither creates it nor leaves an empty one behind."""
    from ldqa.indexes.store import DB_NAME, default_store_dir

    path = Path(store).expanduser() if store else default_store_dir()
    where = f"--store {store}" if store else f"the default store {path}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where} is a file, not a collection directory: give the directory you ingested into")
    if not (path / DB_NAME).is_file():
        raise ValueError(f"{where}: no collection there; add documents first: ldqa ingest PATH"
                         + (f" --store {store}" if store else ""))


def cmd_ask(args) -> int:
    from ldqa.app.options import AnswerOptions

    question = read_question(args)
    if not question.strip():  # before the collection: the first thing wrong is named first
        raise ValueError('question is empty: ask something, e.g. ldqa ask "What is ...?"')
    from ldqa.attention.loader import DEFAULT_MODEL, check_model_name

    check_model_name(args.model or DEFAULT_MODEL)
    check_collection(args.store)
    qa = _qa(args)
    if args.save_settings:
        if args.max_new_tokens is None:
            raise ValueError("--save-settings saves --max-new-tokens: give it (e.g. --max-new-tokens 256)")
        saved = qa.save_answer_settings(args.max_new_tokens)
        print(f"ldqa ask: saved {saved} with the collection {qa.store.path}", file=sys.stderr)
    opts = AnswerOptions.from_args(args, "ask")
    if args.json:
        print(json.dumps(qa.ask(question, opts).to_dict(), indent=1, default=str))
        return 0
    stream = qa.stream(question, opts)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    print_answer_details(stream.answer)
    return 0


def print_answer_details(ans) -> None:
    """What `ldqa ask` and `ldqa demo` print under an answer: its notice, its citations (or the passages
    it used, or for an abstention the nearest ones) and how it was made (`render.answer_facts`)."""
    if ans.notice:
        print(f"  note: {ans.notice}")
    if ans.settings.abstained:
        print(f"  {' | '.join(answer_facts(ans))}; the nearest passages were:")
        for i, p in enumerate(ans.passages[:3], 1):
            print(f"  [{i}] {p.title} ({Path(p.path).name}{f', page {p.page}' if p.page else ''})")
        return
    from ldqa.app.citations import HOW

    for c in ans.citations:
        page = f", page {c.page}" if c.page else ""
        print(f"  [{c.n}] {c.title} ({Path(c.path).name}{page}, chars {c.start}-{c.end}; "
              f"{HOW.get(c.method, c.method)})")
    if not ans.citations:
        print("  passages used:")
        for i, p in enumerate(ans.passages[:3], 1):
            print(f"  [{i}] {p.title} ({Path(p.path).name}{f', page {p.page}' if p.page else ''})")
    print(f"  {' | '.join(answer_facts(ans))}")


def cmd_demo(args) -> int:
    import tempfile

    from ldqa.app.api import precompute_kv_by_default
    from ldqa.app.options import SEARCH_OPTIONS, AnswerOptions
    from ldqa.eval.metrics import best_subspan_em

    if args.store is None:  # a throwaway collection, removed at the end (give --store DIR to keep it)
        with tempfile.TemporaryDirectory(prefix="ldqa-demo-") as tmp:
            args.store = tmp
            return cmd_demo(args)
    opts = AnswerOptions.from_args(args, "demo")
    store = args.store
    qa = _qa(args)
    print(f"== ingesting the bundled sample ({SAMPLE_DIR / 'docs'}) into {store}")
    report = qa.ingest([SAMPLE_DIR / "docs"])
    for f in report.files:
        print(f"  {f.status:9s} {Path(f.path).name}: {f.chunks} chunks {f.reason}")
    if opts.attention.startswith("block") and precompute_kv_by_default():  # as `ldqa ingest` does by default
        kv = qa.precompute_kv(attention=opts.attention)
        print("  KV blocks: " + precompute_line(kv))
    questions = [json.loads(line) for line in (SAMPLE_DIR / "questions.jsonl").read_text().splitlines() if line.strip()]
    debias = _debias_of(opts)
    setting = f"attention {opts.attention}, debias {debias}"
    correct = 0
    results, answers = [], []
    for q in questions:
        print(f"\n== Q: {q['question']}")
        ans = qa.ask(q["question"], opts)
        ok = best_subspan_em(ans.text, q["answers"])
        correct += ok
        print(f"A: {ans.text}\n   gold: {' | '.join(q['answers'])}  -> {'correct' if ok else 'wrong'}")
        print_answer_details(ans)
        results.append(ans.to_dict() | {"gold": q["answers"], "correct": ok})
        answers.append(ans)
    # the same questions in a second setting, one line each beside the answers above: exact full attention
    # without debiasing, or, when that is the setting, block attention with its default debiasing (the search
    # options and the answer cap as in the first setting)
    kept = {name: getattr(opts, name) for name in (*SEARCH_OPTIONS, "max_new_tokens")}
    second = AnswerOptions(**kept, attention="block") if (opts.attention, debias) == ("full", "none") else \
        AnswerOptions(**kept, attention="full", debias="none")
    other = (second.attention, _debias_of(second))
    if not args.no_compare:
        label = f"attention {other[0]}, debias {other[1]}"
        print(f"\n== the same questions: {setting} | {label}")
        other_correct = 0
        for q, r, first in zip(questions, results, answers):
            ans = qa.ask(q["question"], second)
            ok = best_subspan_em(ans.text, q["answers"])
            other_correct += ok
            r["compared"] = {"attention": other[0], "debias": other[1], "text": ans.text, "correct": ok,
                             "ttft_ms": ans.timings.ttft_ms, "total_ms": ans.timings.total_ms}
            print(f"  {_short(q['question'], 34)} | {_cell(first.text, r['correct'], first.timings)} "
                  f"| {_cell(ans.text, ok, ans.timings)}")
        print(f"  correct: {int(correct)}/{len(questions)} ({setting}) | {int(other_correct)}/{len(questions)} "
              f"({label})")
    also = "" if args.no_compare else f"; {int(other_correct)}/{len(questions)} with {label}"
    print(f"\n== {int(correct)}/{len(questions)} answers contain the gold answer (best-subspan EM); "
          f"{setting}{also}; model {qa.model_name}, weights {qa.weights}, {qa.device}")
    if args.json:
        print(json.dumps(results, indent=1, default=str))
    return 0


def _debias_of(opts) -> str:
    """The debias method `opts` (`AnswerOptions`) answer with: its own, or its attention mode's default
    (`AttentionConfig.resolved`)."""
    return opts.attention_config().resolved().debias.method


def _short(text: str, n: int) -> str:
    """`text` on one line, cut to n characters with an ellipsis."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _cell(text: str, ok: float, timings) -> str:
    """One answer in the demo's side-by-side line: correct or not, TTFT, total time (its `Timings`), the
    answer's start."""
    when = f"TTFT {timings.ttft_ms / 1000:4.1f} s, total {timings.total_ms / 1000:4.1f} s"
    return f"{'ok ' if ok else 'no '} {when}: {_short(text, 28):28s}"


def cmd_eval(args) -> int:
    from ldqa.eval.harness import main_from_args

    return main_from_args(args)


def cmd_serve(args) -> int:
    """`ldqa serve`. The model is checked (file, architecture) by the LongDocQA constructor before anything
    listens: a bad one exits 2 with the message. The weights then load in the background while the page is
    up; if that load fails, the server is closed and the command exits 2 with the error (no page that
    answers HTTP 200 but can never answer a question)."""
    import threading
    import time

    from ldqa.app.collections import check_shared_store, serve_layout
    from ldqa.app.ui import UIConfig, build_app, launch, read_auth
    from ldqa.indexes.store import default_store_dir

    auth = read_auth(args.auth_file, os.environ)
    root = args.store or default_store_dir()
    shared = (check_shared_store(args.shared_store, root, login=bool(auth)),) if args.shared_store else ()
    store, users, note = serve_layout(root, login=bool(auth))
    if note:
        print(f"ldqa serve: {note}", file=sys.stderr)
    args.store = str(store)
    qa = _qa(args, max_new_tokens=args.max_new_tokens)  # raises (exit 2) for a missing/unsupported model
    cfg = UIConfig(concurrency=args.concurrency, max_upload_mb=args.max_upload_mb, max_new_tokens=qa.max_new_tokens,
                   users_dir=users, shared_stores=shared)
    app = build_app(qa, cfg)
    failed: list[Exception] = []

    def warm_up():  # the page is up while the models load; a load that fails stops the server
        try:
            qa.warm_up()
        except Exception as e:
            failed.append(e)
            for _ in range(1200):  # close() is a no-op until the app runs: wait (2 minutes at most) for it
                if app.is_running:
                    break
                time.sleep(0.1)
            app.close(verbose=False)  # launch() below returns

    threading.Thread(target=warm_up, daemon=True).start()
    where = (f"a collection per user in {users}, shared collection {qa.store.path}" if users
             else f"collection {qa.store.path}") + "".join(f", shared collection {p}" for p in cfg.shared_stores)
    print(f"ldqa serve: {where}, model {qa.model_name}; http://{args.host}:{args.port}"
          + (" (login required)" if auth else ""), file=sys.stderr)
    launch(app, cfg, host=args.host, port=args.port, auth=auth, block=True)
    if failed:
        print(f"ldqa serve: error: model {qa.model_name} could not be loaded, server stopped: {failed[0]}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
