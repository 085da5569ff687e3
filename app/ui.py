"""ldqa's web app: a Gradio Blocks page over one shared `LongDocQA` (``ldqa serve``).

    ldqa serve --store ~/kiln-docs               # http://127.0.0.1:7860
    from ldqa.app.ui import build_app, launch     # build_app(qa) -> gr.Blocks; launch(app, ...) serves it

Tabs: Chat (streamed answers with [n] citations that open the cited passage, the retrieved passages with
their dense/BM25/fused scores, per-answer timings), Documents (multi-file upload with per-file results,
the collection, delete) and Eval (a needle-in-a-haystack run of `ldqa.eval.harness` over the bundled
sample, on the Chat settings).

Sharing between sessions: without login every browser session shares the server's `LongDocQA` (one
store, one model), and an upload that replaces a file another session uploaded says so. With login
(`UIConfig.users_dir`) each user has a private collection (`ldqa.app.collections`), a `with_store` copy
of the server's `LongDocQA` that shares its model, exact-prefill memo and generation lock; shared
collections (`UIConfig.shared_stores`, and in per-user mode the app's own collection) are searched with
it and never written. The API serializes ingest/delete per collection and generation across all of
them, and `Store` is thread-safe. A session's chat lives only in its own component values and
`gr.State`, so two sessions never see each other's answers. The queue runs at most
`UIConfig.concurrency` events at a time (the Eval run: one at a time).
"""

from __future__ import annotations

import html
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from ldqa.app.api import LongDocQA
from ldqa.app.citations import HOW
from ldqa.app.collections import LOGIN_HINT, user_dir_name
from ldqa.app.options import AnswerOptions, bounds, default, knob
from ldqa.app.render import answer_facts
from ldqa.retrieval.loaders import SUPPORTED_EXTENSIONS

SAMPLE_DIR = Path(__file__).parent / "sample"
ALLOWED_TYPES = "PDF, TXT, MD or HTML"
INGEST_HEADERS = ["file", "result", "chunks", "details"]
DOC_HEADERS = ["id", "document", "type", "size", "chunks", "added (UTC)"]
PASSAGE_HEADERS = ["#", "document", "fused", "dense", "BM25", "cited"]
_MARKER = re.compile(r"\[\d{1,3}\]")
_SENTENCE = re.compile(r"\S[^\n]*?(?:[.!?](?=\s|$)|(?=\n)|$)")  # ends at .!? + space, a newline or the end
CHAT_EXCERPT_CHARS = 240  # characters shown either side of a cited span in the chat
EMPTY_COLLECTION = ("No documents yet. Add some in the **Documents** tab (or load the bundled sample "
                    "there), then ask again.")


@dataclass
class UIConfig:
    """Server-wide settings of the web app.

    concurrency : events the queue runs at once (gr.Blocks.queue default_concurrency_limit).
    max_upload_mb : largest accepted file (MB); larger uploads are refused with a message.
    max_new_tokens : default answer cap (tokens) shown in the Chat settings.
    users_dir : per-user collections (needs a login page): user NAME reads and writes only the collection
        in users_dir/<`user_dir_name`(NAME)>, and searches the app's own collection with it, read-only;
        None: every session uses the app's collection.
    shared_stores : directories of collections every session also searches, read-only (`ldqa serve
        --shared-store`).
    """

    concurrency: int = 2
    max_upload_mb: float = 50.0
    max_new_tokens: int = 64
    users_dir: str | Path | None = None
    shared_stores: tuple = ()

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_upload_mb <= 0:
            raise ValueError(f"max_upload_mb must be > 0, got {self.max_upload_mb}")
        self.shared_stores = tuple(self.shared_stores or ())


class Server:
    """The state every session shares: the app's `LongDocQA`, the per-user collections made from it, and
    their per-model copies.

    Event handlers are methods; they take the session's `gr.Request` (its user and session id) and never
    keep per-session data on `self`.
    """

    def __init__(self, qa: LongDocQA, cfg: UIConfig):
        from ldqa.indexes.store import Store

        self.qa, self.cfg = qa, cfg
        others = [Store(Path(p), qa.embedder.name, qa.embedder.dim) for p in cfg.shared_stores]
        if cfg.users_dir is None:  # one collection for every session: the app's, searched with the shared ones
            self.shared = others
            self.base = qa.with_store(qa.store, search_also=others) if others else qa
        else:  # the app's collection is the shared one every user searches
            self.shared = [qa.store, *others]
            self.base = None
        self._collections: dict[str, LongDocQA] = {}
        self._models: dict[tuple, LongDocQA] = {(None, qa.model_name): self.base or qa}
        self._lock = threading.Lock()  # creating a user's collection or a model copy
        self._files_lock = threading.Lock()  # copy + ingest of one upload, so two same-named files never mix
        self._uploaded_by: dict[str, str] = {}  # uploaded file path -> session that last ingested it

    @property
    def per_user(self) -> bool:
        """Whether each logged-in user has a private collection."""
        return self.cfg.users_dir is not None

    def collection(self, request: gr.Request | None) -> LongDocQA:
        """The collection of `request`'s session: its user's (created on first use) with login, else the
        app's. Raises gr.Error in per-user mode when the request carries no user."""
        if not self.per_user:
            return self.base
        user = getattr(request, "username", None)
        if not user:
            raise gr.Error("This server keeps a collection per user: log in first.")
        with self._lock:
            if user not in self._collections:
                path = Path(self.cfg.users_dir) / user_dir_name(user)
                self._collections[user] = self.qa.with_store(path, search_also=self.shared)
            return self._collections[user]

    def qa_for(self, model: str, request: gr.Request | None = None) -> LongDocQA:
        """The LongDocQA of `request`'s collection answering with `model` (same store and locks); in
        per-user mode, the app's own for request None."""
        user = getattr(request, "username", None) if self.per_user else None
        key = (user, model)
        if key not in self._models:
            qa = self.qa if self.per_user and request is None else self.collection(request)
            with self._lock:
                self._models.setdefault(key, qa.with_model(model))
        return self._models[key]

    def answer_cap(self, model: str, value) -> gr.Slider:
        """The "Max new tokens" control for `model`: 1 to its context window (tokens), never below the
        current `value`, so the control never refuses a question (an answer budget the prompt cannot fit
        beside gets the API's "lower max_new_tokens" error in the chat instead)."""
        try:
            window = self.qa_for(model).context_length
        except Exception:  # a model that cannot load: the question says why, the control stays as it is
            return gr.skip()
        return answer_cap_slider(window, int(value or self.cfg.max_new_tokens))

    # ------------------------------------------------------------------ documents
    def status(self, request: gr.Request | None = None) -> str:
        """The header line: whose collection, its documents and chunks, the shared ones, the model."""
        model = f"model `{Path(self.qa.model_name).name}`"
        if self.per_user and request is None:
            return f"**ldqa** · {model}"
        qa = self.collection(request)
        docs = qa.documents()
        owner = (f"**{html.escape(request.username)}**'s collection" if self.per_user else "collection")
        shared = sum(s.n_documents() for s in self.shared)
        also = f" · {shared} shared documents (read-only)" if self.shared else ""
        return (f"**ldqa** · {owner} `{qa.store.path}` · {len(docs)} documents · "
                f"{sum(d.get('n_chunks') or 0 for d in docs)} chunks{also} · {model}")

    def documents_table(self, request: gr.Request | None = None) -> list[list]:
        """The session's documents (id, name, type, size, chunks, added), then the shared ones (no id:
        they cannot be deleted here)."""
        if self.per_user and request is None:
            return []
        own = self.collection(request).documents()
        shared = [d for s in self.shared for d in s.documents()]
        return [_doc_row(d, d["id"], "") for d in own] + [_doc_row(d, "", " (shared)") for d in shared]

    def refresh(self, request: gr.Request = None):
        """(status line, documents table, delete choices) of the session's collection."""
        table = self.documents_table(request)
        choices = [(f"{row[1]} (#{row[0]})", row[0]) for row in table if row[0] != ""]
        return self.status(request), table, gr.Dropdown(choices=choices, value=None)

    def ingest(self, files, request: gr.Request = None, progress=gr.Progress()):
        """Ingest uploaded files one by one into the session's collection, yielding the per-file results
        table as it fills in."""
        paths = [Path(f) for f in (files or [])]
        if not paths:
            yield [["", "nothing to ingest", "", "choose one or more files first"]], *self.refresh(request), None
            return
        qa = self.collection(request)
        session = getattr(request, "session_hash", None) or ""
        rows = [[p.name, "queued", "", ""] for p in paths]
        for i, p in enumerate(paths):
            progress((i, len(paths)), desc=f"ingesting {p.name}", unit="files")
            rows[i][1] = "ingesting…"
            yield rows, gr.skip(), gr.skip(), gr.skip(), gr.skip()
            try:
                rows[i] = self._ingest_one(p, qa, session)
            except Exception as e:  # an unreadable upload, a full disk: this file's error, the others go on
                rows[i] = [p.name, "error", 0, f"{type(e).__name__}: {e}"]
        progress((len(paths), len(paths)), unit="files")
        yield rows, *self.refresh(request), None

    def ingest_sample(self, request: gr.Request = None, progress=gr.Progress()):
        """Ingest the bundled sample documents (same per-file results as an upload)."""
        yield from self.ingest(sorted(str(p) for p in (SAMPLE_DIR / "docs").iterdir()), request, progress)

    def _ingest_one(self, src: Path, qa: LongDocQA, session: str = "") -> list:
        """One file: check type and size, copy into <collection>/uploads, ingest; its results-table row.
        A file that replaces the same-named upload of another browser session says so."""
        if src.suffix.lower() not in SUPPORTED_EXTENSIONS:
            return [src.name, "error", 0, f"type '{src.suffix or 'none'}' is not supported: upload {ALLOWED_TYPES}"]
        size = src.stat().st_size if src.exists() else 0
        if size > self.cfg.max_upload_mb * 2**20:
            return [src.name, "error", 0, f"{size / 2**20:.1f} MB is over the {self.cfg.max_upload_mb:g} MB limit"]
        uploads = _uploads(qa)
        with self._files_lock:
            uploads.mkdir(parents=True, exist_ok=True)
            dest = uploads / src.name
            backup = dest.with_name(dest.name + ".previous") if dest.exists() else None
            if backup:
                dest.replace(backup)
            shutil.copyfile(src, dest)
            r = qa.ingest([dest]).files[0]
            if backup and r.status == "error":
                backup.replace(dest)  # the stored version stays on disk
            elif backup:
                backup.unlink()
            key = str(dest.resolve())
            if qa.store.get_document_by_path(key) is None:
                dest.unlink(missing_ok=True)  # failed, or the same content is stored elsewhere
            before = self._uploaded_by.get(key)
            if r.status in ("added", "replaced"):
                self._uploaded_by[key] = session
        detail = r.reason if r.status in ("error", "skipped") else f"{r.ms / 1000:.1f} s"
        if r.status == "skipped":
            detail = "duplicate: " + detail.replace(str(uploads) + "/", "")
        if r.status == "replaced" and before is not None and before != session:
            detail = (f"replaced the {src.name} another browser session uploaded: every session is now answered "
                      f"from this version; {detail}")
        if r.warnings:
            detail += "; warning: " + " ".join(r.warnings)
        return [src.name, r.status, r.chunks, detail]

    def delete(self, doc_id, request: gr.Request = None):
        """Delete the chosen document of the session's collection (chunks, vectors, KV blocks and its
        uploaded file)."""
        if doc_id is None or doc_id == "":
            return "Choose a document to delete.", *self.refresh(request)
        qa = self.collection(request)
        doc = next((d for d in qa.documents() if d["id"] == int(doc_id)), None)
        if doc is None:
            return f"Document #{doc_id} is already gone.", *self.refresh(request)
        n = qa.delete(int(doc_id))
        path = Path(doc["path"])
        if path.parent == _uploads(qa).resolve():
            path.unlink(missing_ok=True)
        return f"Deleted **{path.name}**: {n} chunks, their vectors and KV blocks.", *self.refresh(request)

    # ------------------------------------------------------------------ chat
    def ask(self, question, history, model, top_k, retriever, attention, debias, max_new, request: gr.Request = None):
        """Stream an answer from the session's collection into its chat; then its citations, passages and
        timings."""
        history = list(history or [])
        q = (question or "").strip()
        if not q:
            yield history, gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": "_retrieving passages…_"}]
        yield history, "", gr.skip(), gr.skip(), gr.skip()
        try:
            opts = chat_options(top_k, retriever, attention, debias, max_new)
            stream = self.qa_for(model, request).stream(q, opts)
        except Exception as e:  # empty collection, bad setting, model that cannot load: say so in the chat
            history[-1] = {"role": "assistant", "content": _ask_error(e)}
            yield history, gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return
        text, pieces = "", iter(stream)
        try:
            for piece in pieces:
                text += piece
                history[-1] = {"role": "assistant", "content": html.escape(text) + " ▍"}
                yield history, gr.skip(), gr.skip(), gr.skip(), gr.skip()
        except Exception as e:  # e.g. non-finite logits mid-answer: say so in the chat, not in a toast
            history[-1] = {"role": "assistant", "content": _ask_error(e)}
            yield history, gr.skip(), gr.skip(), gr.skip(), gr.skip()
            return
        finally:
            pieces.close()  # a closed session releases the model lock
        ans = stream.answer
        history[-1] = {"role": "assistant", "content": answer_markdown(ans)}
        history += citation_messages(ans)
        shown = passage_records(ans)
        first = next((p for p in shown if p["cited"]), shown[0] if shown else None)
        yield history, gr.skip(), passages_table(ans), passage_html(first), shown


# ---------------------------------------------------------------------- rendering

def _uploads(qa: LongDocQA) -> Path:
    """Where the web app keeps the files uploaded to `qa`'s collection (a re-upload replaces by name)."""
    return qa.store.path / "uploads"


def _doc_row(d: dict, doc_id, suffix: str) -> list:
    return [doc_id, Path(d["path"]).name + suffix, d.get("kind") or "", _size(d.get("bytes")), d.get("n_chunks"),
            (d.get("added_at") or "")[:16].replace("T", " ")]


def _size(n) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB"):
        if n < 1024 or unit == "MB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _ask_error(e: Exception) -> str:
    from ldqa.retrieval.retriever import EmptyCollectionError

    if isinstance(e, EmptyCollectionError):
        return EMPTY_COLLECTION
    return f"**Cannot answer:** {html.escape(str(e))}"


def _where(title: str, path: str, page) -> str:
    name = Path(path).name if path else title
    return f"{name} · page {page}" if page else name


def answer_markdown(ans) -> str:
    """The answer with its [n] markers (added for citations ldqa attributed) and the timing line
    (`timing_line`)."""
    text = html.escape(ans.text) if ans.text else "_(the model gave no answer)_"
    missing = [c.n for c in ans.citations if f"[{c.n}]" not in ans.text]
    if missing:
        text += " " + "".join(f"[{n}]" for n in missing)
    if not ans.citations:
        text += "\n\n_No retrieved passage supports this answer verbatim: check the passages on the right._"
    if getattr(ans, "notice", ""):
        text += f"\n\n_Note: {html.escape(ans.notice)}._"
    return text + "\n\n" + timing_line(ans)


def timing_line(ans) -> str:
    """How the answer was made (`render.answer_facts`), joined with " · " in small print."""
    return "<small>" + " · ".join(html.escape(f, quote=False) for f in answer_facts(ans)) + "</small>"


def passage_records(ans) -> list[dict]:
    """The answer's passages as plain dicts for the session state: n, where, text, cited, mark span."""
    cited = {c.n: c for c in ans.citations}
    out = []
    for n, p in enumerate(ans.passages, 1):
        c = cited.get(n)
        mark = None
        if c is not None and c.answer_start is not None:
            mark = (c.answer_start - p.start, c.answer_end - p.start)
        elif c is not None:  # cited by marker or word overlap: the passage's sentence closest to the answer
            mark = closest_sentence(p.text, ans.text)
        out.append({"n": n, "where": _where(p.title, getattr(p, "path", ""), p.page), "text": p.text,
                    "cited": HOW.get(c.method, c.method) if c else "", "mark": mark})
    return out


def closest_sentence(text: str, answer: str, min_share: float = 0.5) -> tuple[int, int] | None:
    """(start, end) in `text` of the sentence holding the largest share (>= min_share) of the answer's
    normalized words, or None."""
    from ldqa.retrieval.text import normalize_answer

    words = set(normalize_answer(_MARKER.sub("", answer)).split())
    best, span = 0.0, None
    for m in _SENTENCE.finditer(text) if words else ():
        share = len(words & set(normalize_answer(m.group()).split())) / len(words)
        if share > best:
            best, span = share, m.span()
    return span if best >= min_share else None


def passage_html(rec: dict | None, context: int | None = None) -> str:
    """A passage for reading: where it is from and its text, the cited span highlighted. context: show
    only that many characters either side of the highlight (an excerpt, for the chat), else all."""
    if not rec:
        return "<div class='ldqa-passage ldqa-muted'>Click a passage in the table to read it here.</div>"
    text = rec["text"]
    s, e = rec["mark"] or (0, 0)
    if not 0 <= s < e <= len(text):
        s = e = 0
    a, b = _excerpt(text, s, e, context) if context is not None and e > s else (0, len(text))
    body = ("…" if a > 0 else "") + html.escape(text[a:s]) + (f"<mark>{html.escape(text[s:e])}</mark>" if e > s else "")
    body = (body + html.escape(text[max(e, a):b]) + ("…" if b < len(text) else "")).replace("\n", "<br>")
    if context is not None:
        return f"<div class='ldqa-passage'><div class='ldqa-text'>{body}</div></div>"
    cited = f" · cited ({rec['cited']})" if rec["cited"] else ""
    return (f"<div class='ldqa-passage'><div class='ldqa-where'>[{rec['n']}] {html.escape(rec['where'])}{cited}"
            f"</div><div class='ldqa-text'>{body}</div></div>")


def _excerpt(text: str, s: int, e: int, context: int) -> tuple[int, int]:
    """[a, b) around the span [s, e) with about `context` characters either side, cut at spaces."""
    a = 0 if s <= context else text.find(" ", s - context, s) + 1 or s - context
    b = len(text) if e + context >= len(text) else text.rfind(" ", e, e + context)
    return a, b if b > e else min(len(text), e + context)


def citation_messages(ans) -> list[dict]:
    """One collapsed chat message per citation, titled "[n] document · page"; opening it shows the
    cited span highlighted in an excerpt of its passage (all of it in the passage viewer)."""
    recs = passage_records(ans)
    return [{"role": "assistant", "content": passage_html(recs[c.n - 1], context=CHAT_EXCERPT_CHARS),
             "metadata": {"title": f"[{c.n}] {recs[c.n - 1]['where']}", "log": HOW.get(c.method, c.method),
                          "status": "done"}}
            for c in ans.citations]


def passages_table(ans) -> list[list]:
    """One row per retrieved passage: #, document (and page), fused (RRF; hybrid only), dense (cosine)
    and BM25 scores (blank when the passage was not in that list), how it is cited."""
    hybrid = ans.settings.retriever == "hybrid"
    cited = {c.n: HOW.get(c.method, c.method) for c in ans.citations}

    def f(x, digits):
        return "" if x is None else f"{x:.{digits}f}"

    return [[n, _where(p.title, getattr(p, "path", ""), p.page).replace(" · page ", " p."),
             f(p.score, 4) if hybrid else "", f(getattr(p, "dense_score", None), 3),
             f(getattr(p, "bm25_score", None), 2), cited.get(n, "")] for n, p in enumerate(ans.passages, 1)]


def show_passage(records, evt: gr.SelectData):
    """The passage of the clicked table row."""
    row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
    return passage_html(records[row] if records and 0 <= row < len(records) else None)


# ---------------------------------------------------------------------- eval

DEFAULT_CHOICE = "default (the mode's measured best)"


def _debias(choice: str | None) -> str | None:
    """The debias dropdown's value as the API takes it: None for `DEFAULT_CHOICE` (the attention mode's
    default, filled by `AttentionConfig.resolved`: none with full attention, calibrate+reorder in block
    modes, none with retrieval)."""
    return None if choice in (None, DEFAULT_CHOICE) else choice


def chat_options(top_k, retriever, attention, debias, max_new) -> AnswerOptions:
    """The `AnswerOptions` of the Chat settings' values, in the order of their controls (the /ask
    endpoint's inputs after the question, the chat and the model; sliders give numbers, the debias
    dropdown may give `DEFAULT_CHOICE`). Raises ValueError naming the option for a value it does not
    allow."""
    return AnswerOptions(top_k=int(top_k), retriever=retriever, attention=attention, debias=_debias(debias),
                         max_new_tokens=int(max_new))


def run_eval(model, attention, debias, lengths, depths, compare_full, store_dir, progress=gr.Progress(track_tqdm=True)):
    """Needle in a haystack over the bundled sample's text (ldqa.eval.harness, benchmark "niah") on the
    Chat settings; returns (summary markdown, NIAH heatmap, TTFT plot)."""
    from PIL import Image

    from ldqa.eval.harness import EvalConfig, run, summary_markdown

    if not lengths or not depths:
        raise gr.Error("Choose at least one context length and one needle depth.")
    try:  # the mode's default debiasing and the combination rules of AttentionConfig.resolved
        debias = AnswerOptions(attention=attention, debias=_debias(debias)).attention_config().resolved().debias.method
    except ValueError as e:
        raise gr.Error(str(e)) from e
    out = Path(store_dir) / "eval-ui"
    mode = attention + (f"/{debias}" if debias != "none" else "")
    modes = [mode] + (["full"] if compare_full and mode != "full" else [])
    cfg = EvalConfig(benchmark="niah", data=str(_sample_haystack(out / "haystack")), out=str(out),
                     modes=",".join(modes), model=model, lengths=",".join(map(str, sorted(int(x) for x in lengths))),
                     depths=",".join(map(str, sorted(int(x) for x in depths))), passage_tokens=128, max_new_tokens=16)
    try:
        result = run(cfg)
    except ValueError as e:  # a setting the harness refuses: say which
        raise gr.Error(str(e)) from e
    images = [Image.open(out / name).copy() if (out / name).exists() else None
              for name in ("niah_heatmap.png", "ttft_vs_length.png")]
    return summary_markdown(result).replace("# ldqa eval niah", "#### Needle in a haystack (bundled sample)"), *images


def _sample_haystack(d: Path) -> Path:
    """The bundled sample's documents as plain .txt files (the niah haystack)."""
    from ldqa.retrieval.loaders import load_document

    if not d.is_dir() or not any(d.glob("*.txt")):
        d.mkdir(parents=True, exist_ok=True)
        for p in sorted((SAMPLE_DIR / "docs").iterdir()):
            (d / (p.stem + ".txt")).write_text(load_document(p).text, encoding="utf-8")
    return d


# ---------------------------------------------------------------------- page

CSS = """
.ldqa-passage { font-size: 0.92em; line-height: 1.5; }
.ldqa-where { font-weight: 600; margin-bottom: 0.4em; }
.ldqa-text { max-height: 420px; overflow-y: auto; white-space: normal; }
.ldqa-muted { color: var(--body-text-color-subdued); }
.ldqa-passage mark { background: #fde68a; color: inherit; padding: 0 2px; border-radius: 2px; }
#ldqa-header p { margin: 0; }
footer { display: none !important; }
"""


def build_app(qa: LongDocQA, cfg: UIConfig | None = None) -> gr.Blocks:
    """The Gradio Blocks page over `qa`: every session's collection, or with `cfg.users_dir` the shared
    collection every user searches beside a private one. Launch it with `launch`."""
    from ldqa.attention.loader import PACKAGED_MODELS

    cfg = cfg or UIConfig(max_new_tokens=qa.max_new_tokens)
    srv = Server(qa, cfg)
    docs_label = ("Your collection (only you see it), then the shared documents (read-only)" if srv.per_user else
                  "Collection" + (", then the shared documents (read-only)" if srv.shared else ""))
    models = list(dict.fromkeys([qa.model_name, *PACKAGED_MODELS]))
    examples = sample_examples([qa.store, *srv.shared])
    with gr.Blocks(title="ldqa — ask your documents") as app:
        header = gr.Markdown(srv.status(), elem_id="ldqa-header")
        with gr.Tabs(selected="chat" if qa.documents() and not srv.per_user else "docs"):
            with gr.Tab("Chat", id="chat"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=11):
                        chatbot = gr.Chatbot(label="Answers", height=560, elem_id="ldqa-chat", buttons=["copy"],
                                             feedback_options=None, layout="bubble",
                                             placeholder="Ask about your documents. Answers cite passages as **[n]**: "
                                                         "open a citation under an answer to read the passage.")
                        with gr.Row():
                            question = gr.Textbox(placeholder="Ask a question about your documents…", show_label=False,
                                                  scale=6, container=False, elem_id="ldqa-question", autofocus=True)
                            ask_btn = gr.Button("Ask", variant="primary", scale=1, min_width=90, elem_id="ldqa-ask")
                        if examples:
                            gr.Examples(examples, inputs=question, label="Questions about the bundled sample")
                    with gr.Column(scale=9):
                        with gr.Accordion("Settings", open=False):
                            model = gr.Dropdown(models, value=qa.model_name, label="Model")
                            top_k = option_slider("top_k")
                            retriever = option_choice("retriever", gr.Radio)
                            attention = option_choice("attention")
                            debias = option_choice("debias")
                            max_new = answer_cap_slider(qa.context_length, cfg.max_new_tokens)
                        passages = gr.Dataframe(headers=PASSAGE_HEADERS, label="Retrieved passages (click a row to read it)",
                                                interactive=False, elem_id="ldqa-passages", max_height=360,
                                                column_widths=["7%", "31%", "16%", "15%", "13%", "18%"])
                        viewer = gr.HTML(passage_html(None), elem_id="ldqa-viewer")
                records = gr.State([])
            with gr.Tab("Documents", id="docs"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1):
                        files = gr.File(label=f"Add documents: {ALLOWED_TYPES}, up to {cfg.max_upload_mb:g} MB each",
                                        file_count="multiple", type="filepath", elem_id="ldqa-upload", height=150)
                        sample_btn = gr.Button("Load the bundled sample (4 documents about a lumber kiln)", size="sm")
                        results = gr.Dataframe(headers=INGEST_HEADERS, label="Ingestion results", interactive=False,
                                               elem_id="ldqa-ingest-results", wrap=True,
                                               column_widths=["30%", "15%", "14%", "41%"])
                    with gr.Column(scale=1):
                        docs = gr.Dataframe(srv.documents_table(), headers=DOC_HEADERS, label=docs_label,
                                            interactive=False, elem_id="ldqa-docs", wrap=True,
                                            column_widths=["7%", "35%", "9%", "13%", "11%", "25%"])
                        with gr.Row():
                            doc_pick = gr.Dropdown([], label="Document to delete", scale=3)
                            delete_btn = gr.Button("Delete", variant="stop", scale=1, min_width=90)
                        delete_msg = gr.Markdown()
            with gr.Tab("Eval", id="eval"):
                gr.Markdown("Needle in a haystack over the bundled sample's text: a sentence is hidden at each depth "
                            "of a context of each length, and the model is asked for it. Runs with the model, "
                            "attention mode and debiasing of the Chat settings; answers are cached, so a rerun "
                            "with the same settings is instant.")
                with gr.Row():
                    lengths = gr.CheckboxGroup(["256", "512", "1024"], value=["256", "512"], label="Context lengths (tokens)")
                    depths = gr.CheckboxGroup(["0", "50", "100"], value=["0", "50", "100"], label="Needle depth (%)")
                    compare = gr.Checkbox(True, label="Also run full attention")
                eval_btn = gr.Button("Run the benchmark", variant="primary")
                eval_table = gr.Markdown(elem_id="ldqa-eval-table")
                with gr.Row():
                    heatmap = gr.Image(label="Accuracy by length and depth", type="pil", interactive=False)
                    ttft = gr.Image(label="TTFT vs context length", type="pil", interactive=False)
        store_dir = gr.State(str(Path(cfg.users_dir).parent if srv.per_user else qa.store.path))

        listing = [header, docs, doc_pick]
        settings = [model, top_k, retriever, attention, debias, max_new]
        ask_io = dict(fn=srv.ask, inputs=[question, chatbot, *settings], outputs=[chatbot, question, passages, viewer, records])
        ask_btn.click(**ask_io, api_name="ask")
        model.change(srv.answer_cap, inputs=[model, max_new], outputs=max_new, api_name=False)
        question.submit(**ask_io, api_name=False)
        passages.select(show_passage, inputs=records, outputs=viewer, api_name=False)
        files.upload(srv.ingest, inputs=files, outputs=[results, *listing, files], api_name="ingest")
        sample_btn.click(srv.ingest_sample, outputs=[results, *listing, files], api_name="ingest_sample")
        delete_btn.click(srv.delete, inputs=doc_pick, outputs=[delete_msg, *listing], api_name="delete")
        eval_btn.click(run_eval, inputs=[model, attention, debias, lengths, depths, compare, store_dir],
                       outputs=[eval_table, heatmap, ttft], api_name="eval", concurrency_limit=1)
        app.load(srv.refresh, outputs=listing, api_name="documents")
    return app


def option_choice(name: str, kind=gr.Dropdown):
    """A Chat-settings control of `AnswerOptions` field `name`: a `kind` (gr.Dropdown, gr.Radio) over its
    allowed values, showing its default and its label; a field whose default is None (the debias method:
    the attention mode's own) offers `DEFAULT_CHOICE` first and shows it."""
    k = knob(name)
    choices = ([DEFAULT_CHOICE] if default(name) is None else []) + list(k.choices)
    return kind(choices, value=DEFAULT_CHOICE if default(name) is None else default(name), label=k.label)


def option_slider(name: str) -> gr.Slider:
    """A Chat-settings slider of integer `AnswerOptions` field `name`: its allowed minimum to its
    `Knob.slider_max`, at its default, with its label."""
    low, _ = bounds(name)
    return gr.Slider(low, knob(name).slider_max, value=default(name), step=1, label=knob(name).label)


def answer_cap_slider(window: int, value: int) -> gr.Slider:
    """The "Max new tokens" slider: `AnswerOptions.max_new_tokens`'s allowed range, 1 to the model's
    context window `window` (tokens), showing `value` (the saved or served answer cap); its maximum is
    raised to `value` when that is larger, so a saved cap is shown as it is and never makes the web app
    refuse a question (the answer budget check says "lower max_new_tokens" in the chat instead)."""
    low, high = bounds("max_new_tokens", context_length=window)
    return gr.Slider(low, max(high, value), value=value, step=1, label=knob("max_new_tokens").label,
                     info=f"answer length cap; the model's window is {window:,} tokens", elem_id="ldqa-max-new")


def sample_examples(stores) -> list[str]:
    """Three of the bundled sample's questions when `stores` (`Store`s) hold no document yet (the Documents
    tab's button loads the sample) or one of them holds a sample document (matched by file name); none over
    a collection of other documents, where they would only mislead."""
    names = {p.name for p in (SAMPLE_DIR / "docs").iterdir()}
    docs = [Path(d["path"]).name for st in stores for d in st.documents()]
    if not docs or any(n in names for n in docs):
        return [q["question"] for q in _sample_questions()[:3]]
    return []


def _sample_questions() -> list[dict]:
    import json

    path = SAMPLE_DIR / "questions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(app: gr.Blocks, cfg: UIConfig, host: str = "127.0.0.1", port: int = 7860,
           auth: list[tuple[str, str]] | None = None, block: bool = True) -> str:
    """Serve `app` on host:port (never shared publicly); returns the local URL. block=False returns at
    once (tests); close with `app.close()`. Raises OSError when the port is taken, ValueError when `cfg`
    has per-user collections (users_dir) and `auth` no users."""
    if cfg.users_dir is not None and not auth:
        raise ValueError(f"per-user collections need a login page: give users ({LOGIN_HINT})")
    app.queue(default_concurrency_limit=cfg.concurrency)
    _, url, _ = app.launch(server_name=host, server_port=port, share=False, auth=auth, show_error=True,
                           max_file_size=f"{cfg.max_upload_mb:g}mb", prevent_thread_lock=not block, quiet=not block,
                           theme=gr.themes.Soft(primary_hue="amber", neutral_hue="slate"), css=CSS,
                           footer_links=[], ssr_mode=False)
    return url


def read_auth(auth_file: str | None, env: dict) -> list[tuple[str, str]] | None:
    """Credentials for the login page: `auth_file` (lines "user:password"; # comments) or the environment
    variables LDQA_UI_USER and LDQA_UI_PASSWORD; None when neither is given.

    Raises ValueError naming the file and line when a line has no "user:password", or when only one of
    the two variables is set.
    """
    if auth_file:
        pairs = []
        for i, line in enumerate(Path(auth_file).expanduser().read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, pw = line.partition(":")
            if not sep or not user or not pw:
                raise ValueError(f"--auth-file {auth_file}, line {i}: expected user:password")
            pairs.append((user, pw))
        if not pairs:
            raise ValueError(f"--auth-file {auth_file}: no user:password lines")
        return pairs
    user, pw = env.get("LDQA_UI_USER"), env.get("LDQA_UI_PASSWORD")
    if bool(user) != bool(pw):
        raise ValueError("set both LDQA_UI_USER and LDQA_UI_PASSWORD (or neither)")
    return [(user, pw)] if user else None
