"""The `ldqa` console script, run as a user would (subprocess), with a tiny random-weight model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


SAMPLE = Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"


def _ldqa(*args, cwd=None):
    exe = shutil.which("ldqa", path=str(Path(sys.executable).parent)) or "ldqa"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=900, cwd=cwd, env=env)


def test_cli_ingest_then_ask_json(tmp_path, tiny_model_dir):
    model = tiny_model_dir("gemma3")
    store = tmp_path / "store"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"")
    r = _ldqa("ingest", SAMPLE, bad, "--store", store, "--model", model, "--json")
    assert r.returncode == 1, r.stderr  # a file failed; the others are stored
    report = json.loads(r.stdout)
    assert report["added"] == 4 and report["errors"] == 1
    assert "bad.txt" in r.stderr and "no text" in r.stderr  # the failure is named on stderr
    r = _ldqa("ingest", SAMPLE, bad, "--store", store, "--model", model)
    assert r.returncode == 1 and r.stderr.count("no text") == 0 and r.stdout.count("no text") == 1  # once, in the table
    assert "unchanged since it was stored" in r.stdout and "0 added/replaced, 4 skipped, 1 error, " in r.stdout
    r = _ldqa("ingest", SAMPLE, "--store", store, "--model", model)
    assert r.returncode == 0 and "0 errors" in r.stdout

    r = _ldqa("ask", "What torque for the fan hub bolts?", "--store", store, "--model", model, "--top-k", "2",
              "--retriever", "bm25", "--max-new-tokens", "4", "--answer-prefix", "The torque is", "--json")
    assert r.returncode == 0, r.stderr
    ans = json.loads(r.stdout)
    assert ans["settings"]["answer_prefix"] == "The torque is" and "instruction" not in ans["settings"]
    assert set(ans) >= {"text", "citations", "passages", "timings", "settings"}
    assert len(ans["passages"]) == 2 and ans["settings"]["retriever"] == "bm25"
    assert all(p["path"] and p["title"] for p in ans["passages"])
    assert "18 Nm" in " ".join(p["text"] for p in ans["passages"])  # BM25 finds the bulletin's torque

    r = _ldqa("ask", "What torque for the fan hub bolts?", "--store", store, "--model", model, "--top-k", "2",
              "--max-new-tokens", "2", "--attention", "block", "--debias", "calibrate", "--debias-orders", "1",
              "--debias-calibration", "ratio", "--debias-strength", "0.5", "--weights", "int8", "--kv-dtype", "bf16",
              "--json")
    assert r.returncode == 0, r.stderr
    ans = json.loads(r.stdout)
    assert ans["settings"]["weights"] == "int8" and ans["settings"]["kv_dtype"] == "bf16"
    assert ans["settings"]["debias_orders"] == 1 and ans["timings"]["debias_passes"] == 1
    assert ans["settings"]["debias_calibration"] == "ratio" and ans["settings"]["debias_strength"] == 0.5


def test_cli_errors_are_clear(tmp_path, tiny_model_dir):
    model = tiny_model_dir("gemma3")
    r = _ldqa("ask", "anything?", "--store", tmp_path / "empty", "--model", model)
    assert r.returncode == 2 and "ldqa ingest" in r.stderr
    r = _ldqa("ask", "  ", "--store", tmp_path / "empty", "--model", model)
    assert r.returncode == 2 and "question is empty" in r.stderr
    r = _ldqa("ask", "x?", "--store", tmp_path / "empty", "--model", tmp_path / "nope")
    assert r.returncode == 2 and "not found" in r.stderr


def test_generic_package_names_do_not_leak(tmp_path):
    """transformers probes for a top-level `kernels` package (and >= 5.25 installs the Hugging Face one);
    ours lives at ldqa.kernels only, so outside the repository `kernels` and `eval` are never ours."""
    import importlib.metadata

    code = ("import importlib.util, ldqa.kernels, ldqa.eval\n"
            "from transformers.utils import is_kernels_available\n"
            "for name in ('kernels', 'eval'):\n"
            "    spec = importlib.util.find_spec(name)\n"
            "    print(spec.origin if spec else None)\n"
            "print(is_kernels_available())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    kernels, eval_, available = r.stdout.split()[-3:]
    root = Path(__file__).resolve().parents[1]
    try:
        importlib.metadata.version("kernels")
        hf_kernels = True
    except importlib.metadata.PackageNotFoundError:
        hf_kernels = False
    assert eval_ == "None"
    assert (kernels == "None") != hf_kernels and not kernels.startswith(str(root / "kernels"))
    assert available == str(hf_kernels)


def test_demo_without_store_removes_its_temporary_collection(tmp_path, tiny_model_dir):
    env_tmp = tmp_path / "tmp"
    env_tmp.mkdir()
    exe = shutil.which("ldqa", path=str(Path(sys.executable).parent)) or "ldqa"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(env_tmp)}
    r = subprocess.run([exe, "demo", "--model", str(tiny_model_dir("gemma3")), "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr
    assert f"into {env_tmp}" in r.stdout and "answers contain the gold answer" in r.stdout
    assert not list(env_tmp.glob("ldqa-demo-*"))  # the throwaway collection is gone


def test_cli_calibration_choices_are_ldqas_forms():
    from ldqa.app.cli import build_parser
    from ldqa.attention.debias import CALIBRATION_FORMS
    ask = build_parser()._subparsers._group_actions[0].choices["ask"]
    action = next(a for a in ask._actions if a.dest == "debias_calibration")
    assert tuple(action.choices) == CALIBRATION_FORMS
    assert ask.parse_args(["q?", "--debias-calibration", "pearson"]).debias_calibration == "pearson"


def test_cli_recompute_select_choices_are_ldqas_methods():
    from ldqa.app.cli import build_parser
    from ldqa.attention.block_attention import SELECT_METHODS
    ask = build_parser()._subparsers._group_actions[0].choices["ask"]
    action = next(a for a in ask._actions if a.dest == "recompute_select")
    assert tuple(action.choices) == SELECT_METHODS
    assert ask.parse_args(["q?", "--recompute-select", "question"]).recompute_select == "question"


def test_demo_prints_a_second_setting_beside_the_first(tmp_path, tiny_model_dir):
    """`ldqa demo` answers the questions again in a second setting and prints one line per question with
    both answers: full attention without debiasing, or block attention when that is the first setting;
    --no-compare skips it."""
    from ldqa.app.api import DEFAULT_ATTENTION, default_debias

    model = tiny_model_dir("gemma3")
    n = len([ln for ln in (SAMPLE.parent / "questions.jsonl").read_text().splitlines() if ln.strip()])
    for i, (extra, first, second) in enumerate([
        ([], f"attention {DEFAULT_ATTENTION}, debias {default_debias(DEFAULT_ATTENTION)}", None),
        (["--attention", "block"], "attention block, debias calibrate+reorder", "attention full, debias none"),
        (["--debias", "none"], "attention full, debias none", "attention block, debias calibrate+reorder")]):
        if second is None:  # the defaults: compared with whichever of the two they are not
            second = ("attention block, debias calibrate+reorder" if first == "attention full, debias none"
                      else "attention full, debias none")
        r = _ldqa("demo", "--model", model, "--max-new-tokens", "2", *extra, "--store", tmp_path / f"s{i}")
        assert r.returncode == 0, r.stderr
        side = r.stdout.split(f"== the same questions: {first} | {second}\n")
        assert len(side) == 2, r.stdout
        lines = side[1].splitlines()
        assert all(ln.count(" | ") == 2 for ln in lines[:n]), lines[:n]
        assert lines[n].startswith("  correct: ") and f"({second})" in lines[n]
        assert f"answers contain the gold answer (best-subspan EM); {first}; " in r.stdout  # the last line:
        assert f"/{n} with {second}; model " in r.stdout.splitlines()[-1]  # both settings' counts
    r = _ldqa("demo", "--model", model, "--max-new-tokens", "2", "--attention", "block", "--no-compare",
              "--store", tmp_path / "s2")
    assert r.returncode == 0, r.stderr
    assert "== the same questions" not in r.stdout and "attention block, debias calibrate+reorder;" in r.stdout


def test_ingest_precompute_reports_seconds_and_disk_per_1k_tokens(tmp_path, tiny_model_dir):
    from ldqa.app.cli import precompute_line

    r = _ldqa("ingest", SAMPLE, "--store", tmp_path / "s", "--model", tiny_model_dir("gemma3"), "--precompute-kv")
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("KV blocks: ")]
    assert len(line) == 1 and " computed, " in line[0] and "per 1K tokens" in line[0] and "MB of disk" in line[0]
    kv = {"blocks": 24, "computed": 20, "tokens": 4000, "bytes": 76_000_000, "ms": 18_000.0}
    assert precompute_line(kv) == ("24 (20 computed, 4,000 tokens, 76.0 MB) in 18.0 s; per 1K tokens 4.5 s and "
                                   "19.0 MB of disk")
    assert "per 1K" not in precompute_line(kv | {"computed": 0, "tokens": 0, "bytes": 0})  # all stored already


def test_ingest_precompute_default_follows_the_default_attention(monkeypatch):
    from ldqa.app.cli import build_parser
    from ldqa.app.options import AnswerOptions

    for mode, expected in (("full", False), ("block", True)):  # the default's one place: AnswerOptions.attention
        monkeypatch.setattr(AnswerOptions.__dataclass_fields__["attention"], "default", mode)
        ap = build_parser()
        assert ap.parse_args(["ingest", "x"]).precompute_kv is expected
        assert ap.parse_args(["ingest", "x", "--precompute-kv"]).precompute_kv is True
        assert ap.parse_args(["ingest", "x", "--no-precompute-kv"]).precompute_kv is False
        assert ap.parse_args(["ask", "q?"]).attention == mode
        assert ap.parse_args(["ingest", "x"]).precompute_attention == "block"  # whose blocks: the default's
        assert ap.parse_args(["ingest", "x", "--precompute-attention", "block+recompute"]).precompute_attention \
            == "block+recompute"
    monkeypatch.setattr(AnswerOptions.__dataclass_fields__["attention"], "default", "block+recompute")
    assert build_parser().parse_args(["ingest", "x"]).precompute_attention == "block+recompute"


def _ldqa_stdin(stdin: str, *args):
    exe = shutil.which("ldqa", path=str(Path(sys.executable).parent)) or "ldqa"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([exe, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=900, env=env)


def test_ask_reads_the_question_from_stdin_or_a_file_and_checks_its_length_first(tmp_path, tiny_model_dir):
    model = tiny_model_dir("gemma3")
    store = tmp_path / "store"
    assert _ldqa("ingest", SAMPLE / "maintenance_log.txt", "--store", store, "--model", model).returncode == 0
    common = ["--store", store, "--model", model, "--retriever", "bm25", "--max-new-tokens", "2", "--json"]

    question = "On what date was circulation fan No. 2 replaced?"
    r = _ldqa_stdin(question + "\n", "ask", "-", *common)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["question"] == question

    # over a shell's 128 KB argument limit and over the model's 4096-token window: refused as too long,
    # before the relevance check could answer "Not found in the documents"
    long_file = tmp_path / "question.txt"
    long_file.write_text("Which zebra crossed the savanna at noon? " * 4000, encoding="utf-8")
    assert long_file.stat().st_size > 128 * 1024
    r = _ldqa("ask", "--question-file", long_file, *common[:-1], "--abstain-below", "1")
    assert r.returncode == 2, r.stdout
    assert "ldqa ask: error: the question" in r.stderr and "context window of 4096 tokens" in r.stderr
    assert "shorten the question" in r.stderr and "Not found" not in r.stdout

    r = _ldqa("ask", "--question-file", tmp_path / "missing.txt", *common)
    assert r.returncode == 2 and "--question-file" in r.stderr and "missing.txt" in r.stderr
    r = _ldqa("ask", *common)
    assert r.returncode == 2 and "no question" in r.stderr and "--question-file" in r.stderr


def test_serve_help_and_store_errors_name_the_collections(tmp_path):
    r = _ldqa("serve", "--help")
    assert r.returncode == 0 and "--shared-store DIR" in r.stdout and "STORE/users/NAME" in r.stdout
    r = _ldqa("serve", "--store", tmp_path / "store", "--shared-store", tmp_path / "nope")
    assert r.returncode == 2 and f"--shared-store {tmp_path / 'nope'}: no collection there" in r.stderr
    assert "ldqa ingest" in r.stderr
    (tmp_path / "per-user" / "users").mkdir(parents=True)  # a store that has been served with login
    r = _ldqa("serve", "--store", tmp_path / "per-user")
    assert r.returncode == 2 and "serve it with login" in r.stderr and "--store" in r.stderr


def test_ask_over_a_missing_store_creates_nothing_and_a_file_is_no_store(tmp_path):
    missing = tmp_path / "typo" / "store"
    r = _ldqa("ask", "What?", "--store", missing)
    assert r.returncode == 2 and f"--store {missing}: no collection there" in r.stderr
    assert "ldqa ingest PATH --store" in r.stderr and not (tmp_path / "typo").exists()
    (tmp_path / "f").write_text("x")
    for cmd in (("ask", "What?"), ("ingest", tmp_path / "f")):
        r = _ldqa(*cmd, "--store", tmp_path / "f")
        assert r.returncode == 2 and "is a file, not a" in r.stderr and "Errno" not in r.stderr, r.stderr


def test_help_gives_the_defaults_values(tmp_path):
    from ldqa.attention.block_attention import DEFAULT_ANCHOR_PASSAGES, DEFAULT_ANCHORS, DEFAULT_SELECT
    from ldqa.attention.debias import STRENGTH

    text = " ".join(_ldqa("ask", "--help").stdout.split())
    assert f"default: {DEFAULT_SELECT}" in text and f"default: {'on' if DEFAULT_ANCHORS else 'off'}" in text
    assert (f"default {STRENGTH['difference']:.1f} for difference and pearson, {STRENGTH['ratio']:.1f} for ratio"
            in text) and STRENGTH["pearson"] == STRENGTH["difference"]
    assert (f"{DEFAULT_ANCHOR_PASSAGES['block']} in block, {DEFAULT_ANCHOR_PASSAGES['block+recompute']} in "
            "block+recompute") in text
    assert "ldqa/stores/default" in text and "ldqa.attention." not in text  # values, not the code's names


def test_a_bad_flag_gets_one_line_not_the_usage(tmp_path):
    for args, named in ((("ask", "x?", "--top-k", "0"), "--top-k"), (("ask", "x?", "--attention", "blok"), "blok"),
                        (("ingest",), "paths")):
        r = _ldqa(*args)
        assert r.returncode == 2 and named in r.stderr and "usage:" not in r.stderr, r.stderr
        assert "--help` lists every flag" in r.stderr and len(r.stderr.splitlines()) == 2
