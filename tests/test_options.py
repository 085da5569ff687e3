"""`AnswerOptions` (app/options.py) is the one place of every answering knob: the CLI's answering flags, the
web app's Chat settings, the eval harness's lists and the API's checks are made from its fields; it imports
without torch; a value it does not allow is refused with the option's name; the per-mode debias default is
filled by `AttentionConfig.resolved` only."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ldqa.app import options
from ldqa.app.options import AnswerOptions, bounds, default, knob, option_fields

ROOT = Path(__file__).resolve().parents[1]
# flags of `ldqa ask` / `ldqa demo` that are not answering options (the model, the store, the output)
NOT_ANSWERING = {"help", "store", "model", "weights", "kv_dtype", "device", "chat_template", "question", "question_file",
                 "save_settings", "json", "no_compare"}


def _subparser(command: str) -> argparse.ArgumentParser:
    from ldqa.app.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[command]


def test_options_and_the_cli_parser_import_without_torch():
    """With torch unimportable, the options, the whole CLI parser (`ldqa --help`) and its parsing work."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from ldqa.app.options import AnswerOptions\n"
            "from ldqa.app.cli import build_parser, main\n"
            "args = build_parser().parse_args(['ask', 'q?', '--attention', 'block', '--top-k', '3'])\n"
            "print(AnswerOptions.from_args(args).top_k)\n"
            "try:\n"
            "    main(['ask', '--help'])\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code)\n"
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "3" and "--abstain-below" in r.stdout and lines[-2:] == ["exit 0", "False"]


@pytest.mark.parametrize("command", ["ask", "demo"])
def test_every_answering_flag_comes_from_answer_options(command):
    """Each option of the command has its flag, with the field's default and allowed values; every other
    flag of the command is one of the few that are not answering options."""
    p = _subparser(command)
    actions = {a.dest: a for a in p._actions}
    fields = option_fields(command)
    assert fields and set(actions) - NOT_ANSWERING == {f.name for f in fields}
    for f in fields:
        a, k = actions[f.name], f.metadata["knob"]
        assert a.option_strings[0] == "--" + f.name.replace("_", "-") and a.default == f.default, f.name
        assert tuple(a.choices or ()) == k.choices, f.name
        assert a.help and a.help.replace("%%", "%") == k.help.format(default=f.default)
    assert {"instruction", "answer_prefix"} <= set(actions) if command == "ask" else not {"instruction"} & set(actions)


def test_the_flags_parse_to_the_options_and_refuse_a_bad_value_naming_it(capsys):
    p = _subparser("ask")
    argv = ["q?", "--top-k", "3", "--attention", "block", "--no-block-anchors", "--debias-orders", "1",
            "--top-k-keys", "all", "--abstain-below", "0"]
    opts = AnswerOptions.from_args(p.parse_args(argv))
    assert opts == AnswerOptions(top_k=3, attention="block", block_anchors=False, debias_orders=1, top_k_keys="all",
                                 abstain_below=0.0)
    assert AnswerOptions.from_args(p.parse_args(["q?"])) == AnswerOptions()
    for argv, message in ((["--top-k", "0"], "argument --top-k: top_k must be an int >= 1, got 0"),
                          (["--top-k", "x"], "argument --top-k: top_k must be an int >= 1, got 'x'"),
                          (["--debias", "magic"], "argument --debias: debias='magic': choose one of none, calibrate"),
                          (["--recompute-ratio", "1.5"], "argument --recompute-ratio: recompute_ratio must be a "
                                                         "number in [0, 1], got 1.5"),
                          (["--max-new-tokens", "0"], "argument --max-new-tokens: max_new_tokens must be an int >= 1"),
                          (["--abstain-below", "2"], "abstain_below must be a number in [-1, 1], got 2.0")):
        with pytest.raises(SystemExit) as e:
            p.parse_args(["q?", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.parametrize("bad, name", [
    (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"), (dict(retriever="magic"), "retriever"),
    (dict(attention="sparse"), "attention"), (dict(debias="calibrated"), "debias"),
    (dict(debias_orders=3), "debias_orders"),
    (dict(debias_calibration="log"), "debias_calibration"), (dict(debias_strength=-1.0), "debias_strength"),
    (dict(debias_strength=float("nan")), "debias_strength"), (dict(block_headers="sometimes"), "block_headers"),
    (dict(recompute_ratio=1.5), "recompute_ratio"), (dict(recompute_select="best"), "recompute_select"),
    (dict(recompute_select=(0,)), "recompute_select"), (dict(block_anchors="yes"), "block_anchors"),
    (dict(top_k_keys=0), "top_k_keys"), (dict(top_k_keys="some"), "top_k_keys"), (dict(window=0), "window"),
    (dict(sink=-1), "sink"), (dict(estimate=1), "estimate"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(abstain_below=2.0), "abstain_below"), (dict(abstain_below=True), "abstain_below"),
    (dict(instruction=3), "instruction"), (dict(answer_prefix=None), "answer_prefix")])
def test_a_value_the_option_does_not_allow_is_refused_naming_it(bad, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        AnswerOptions(**bad)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        AnswerOptions.of(AnswerOptions(top_k=3), **bad)


def test_allowed_values_and_the_ways_to_build_options():
    assert AnswerOptions(recompute_select=(2, 1), top_k_keys="all", abstain_below=None, debias_strength=0).top_k == 5
    base = AnswerOptions(top_k=3, attention="block")
    assert AnswerOptions.of(base, debias="none") == dataclasses.replace(base, debias="none")
    assert AnswerOptions.of() == AnswerOptions() and AnswerOptions.of(None, top_k=2).top_k == 2
    assert base.overrides() == {"top_k": 3, "attention": "block"} and AnswerOptions(**base.overrides()) == base
    assert AnswerOptions().overrides() == {}
    with pytest.raises(ValueError, match="unknown retrieval setting or answer option topk"):
        AnswerOptions.of(None, topk=8)
    with pytest.raises(TypeError, match="top_k=5"):
        AnswerOptions.of(5)  # an old positional top_k
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.top_k = 4


def test_the_allowed_values_are_the_attention_layers():
    """The choices are the names the attention configurations check against, and the retrieval attention
    options are `RetrievalConfig`'s fields, whose defaults the help states."""
    from ldqa.attention.block_attention import BlockConfig, SELECT_METHODS
    from ldqa.attention.debias import CALIBRATION_FORMS, METHODS
    from ldqa.attention.engine import ATTENTION_MODES
    from ldqa.attention.retrieval_attention import RetrievalConfig

    assert knob("attention").choices == ATTENTION_MODES and knob("debias").choices == METHODS
    assert knob("debias_calibration").choices == CALIBRATION_FORMS
    assert knob("recompute_select").choices == SELECT_METHODS
    for h in knob("block_headers").choices:
        BlockConfig(headers=h)
    group = [f.name for f in option_fields() if f.metadata["knob"].group == "retrieval_attention"]
    assert sorted(group) == sorted(f.name for f in dataclasses.fields(RetrievalConfig))
    for name in group:
        value = getattr(RetrievalConfig(), name)
        assert re.search(rf"default {'off' if value is False else value}\b", knob(name).help), name
    from ldqa.indexes.key_index import KINDS

    assert all(kind in knob("index").help for kind in KINDS)
    assert AnswerOptions(window=16, top_k_keys="all").retrieval_settings() == {"window": 16, "top_k_keys": "all"}


def test_the_per_mode_debias_default_is_filled_by_attention_config_resolved_only():
    from ldqa.attention.choices import DEFAULT_DEBIAS
    from ldqa.attention.engine import AttentionConfig

    for mode, method in DEFAULT_DEBIAS.items():
        given = AnswerOptions(attention=mode).attention_config()
        assert given.debias.method is None  # not filled at the edge
        assert given.resolved().debias.method == method
        assert AttentionConfig.from_kwargs(mode, debias=None).resolved() == given.resolved()
    assert AnswerOptions(attention="block", debias="none").attention_config().resolved().debias.method == "none"
    with pytest.raises(ValueError, match="buckets"):
        AnswerOptions(attention="block", debias="buckets").attention_config().resolved()
    callers = []
    for path in sorted(p for d in ("app", "attention", "eval") for p in (ROOT / d).rglob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bdefault_debias\(", line) and not line.lstrip().startswith("def "):
                callers.append(f"{path.relative_to(ROOT)}:{i}")
    assert [c.split(":")[0] for c in callers] == ["attention/engine.py"], callers


def test_the_web_apps_chat_settings_come_from_the_options():
    gr = pytest.importorskip("gradio")
    from ldqa.app.ui import DEFAULT_CHOICE, answer_cap_slider, chat_options, option_choice, option_slider

    top_k = option_slider("top_k")
    assert (top_k.minimum, top_k.maximum) == (bounds("top_k")[0], knob("top_k").slider_max)
    assert top_k.value == default("top_k")
    for name in ("retriever", "attention"):
        c = option_choice(name, gr.Radio)
        assert [v for v, _ in c.choices] == list(knob(name).choices) and c.value == default(name)
        assert c.label == knob(name).label
    debias = option_choice("debias")
    assert [v for v, _ in debias.choices] == [DEFAULT_CHOICE, *knob("debias").choices]
    assert debias.value == DEFAULT_CHOICE
    cap = answer_cap_slider(4096, 64)
    assert (cap.minimum, cap.maximum) == bounds("max_new_tokens", context_length=4096) == (1, 4096)
    assert cap.label == knob("max_new_tokens").label
    assert chat_options(3.0, "bm25", "block", DEFAULT_CHOICE, 16.0) == AnswerOptions(
        top_k=3, retriever="bm25", attention="block", max_new_tokens=16)
    with pytest.raises(ValueError, match="^max_new_tokens"):
        chat_options(3, "bm25", "block", "none", 0)


def test_the_eval_harness_reads_its_lists_from_the_options():
    from ldqa.eval import harness
    from ldqa.eval.answering import mode_options

    assert harness.ENGINES == (*knob("attention").choices, "hf") and harness.DEBIAS_METHODS == knob("debias").choices
    assert harness.RETRIEVERS == knob("retriever").choices
    p = argparse.ArgumentParser()
    harness.add_arguments(p)
    select = next(a for a in p._actions if a.dest == "recompute_select")
    assert tuple(select.choices) == (*knob("recompute_select").choices, "oracle")
    cfg = harness.EvalConfig(benchmark="nq-multidoc", data="x", recompute_select="oracle", recompute_ratio=0.5)
    opts = mode_options(cfg, harness.Mode("block+recompute", "sort"), {"gold_position": 3}, 16)
    assert opts == AnswerOptions(attention="block+recompute", debias="sort", max_new_tokens=16, recompute_ratio=0.5,
                                 recompute_select=(3,))
    with pytest.raises(ValueError, match="^recompute_ratio"):
        harness._validate(dataclasses.replace(cfg, data=__file__, recompute_select=None, recompute_ratio=2.0))


def test_the_eval_harness_passes_the_debias_strength_to_the_calibrate_methods_only():
    from ldqa.eval import harness
    from ldqa.eval.answering import mode_options

    p = argparse.ArgumentParser()
    harness.add_arguments(p)
    args = p.parse_args(["nq-multidoc", "--data", "x", "--debias-strength", "1.8"])
    cfg = harness.EvalConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(harness.EvalConfig)})
    assert cfg.debias_strength == 1.8
    for debias in ("calibrate", "calibrate+reorder"):
        assert mode_options(cfg, harness.Mode("block", debias), {}, 16).debias_strength == 1.8
    for debias in ("none", "sort"):
        assert mode_options(cfg, harness.Mode("block", debias), {}, 16).debias_strength is None
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="^debias_strength"):
            harness._validate(dataclasses.replace(cfg, data=__file__, debias_strength=bad))
