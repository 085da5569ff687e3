"""Fail fast: an unusable model is refused when it is named (the LongDocQA
constructor, `ldqa serve` before it listens), with a message naming what was found and what is supported;
non-finite logits raise instead of giving an empty answer; float16 is refused with the reason.

Everything runs on made-up inputs: tiny GGUF files written with gguf.GGUFWriter (no weights worth the
name), config.json files, random-weight tiny models (conftest) whose forward is patched to give NaN. No test
depends on what a model answers."""

from __future__ import annotations

import copy
import json
import shutil
import sqlite3
import threading
import time

import numpy as np
import pytest
import torch

from ldqa.app.api import LongDocQA
from ldqa.app.cli import main
from ldqa.attention import loader, model_sources
from ldqa.attention.config import UnsupportedModelError
from ldqa.attention.generate import NonFiniteLogitsError, SamplingConfig, start_generation
from ldqa.attention.loader import (ModelLoadError, check_kv_dtype, check_model_name, default_weights,
                                   gguf_architecture, load_model)
from ldqa.attention.model import Transformer
from ldqa.attention.quant import WeightFormatError

PASSAGES = [{"title": "Kiln", "text": "The kiln dries oak boards for nine days at 60 degrees."}]


def write_gguf(path, arch: str, arch_last: bool = False, big_endian: bool = False):
    """A tiny GGUF whose general.architecture is `arch` (a few metadata keys, one 4x8 tensor). arch_last:
    write that key after an array of strings and other keys (llama.cpp writes it first)."""
    import gguf

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), arch, endianess=endian)
    if arch_last:
        arch_value = w.kv_data[0].pop("general.architecture")
        w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "kiln", "oak"])
        w.add_array("tokenizer.ggml.scores", [0.0, 0.5, 1.0, 1.5])
        w.add_string("general.name", "made up")
        w.add_bool("general.flag", True)
        w.kv_data[0]["general.architecture"] = arch_value
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------ item 6

@pytest.mark.parametrize("arch_last,big_endian", [(False, False), (True, False), (False, True)])
def test_gguf_architecture_is_read_from_the_header(tmp_path, arch_last, big_endian):
    from gguf import GGUFReader

    path = write_gguf(tmp_path / "m.gguf", "phi3", arch_last, big_endian)
    assert gguf_architecture(path) == "phi3"
    if not big_endian:  # agrees with the gguf package's full reader
        f = GGUFReader(str(path)).fields["general.architecture"]
        assert bytes(f.parts[f.data[0]]).decode() == "phi3"
    assert gguf_architecture(write_gguf(tmp_path / "q.gguf", "qwen3", arch_last, big_endian)) == "qwen3"


def test_unsupported_gguf_is_refused_naming_architecture_families_and_formats(tmp_path):
    path = write_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(UnsupportedModelError) as e:
        check_model_name(str(path))
    msg = str(e.value)
    assert "'phi3'" in msg and "general.architecture" in msg and str(path) in msg
    for family in ("Llama", "Qwen2", "Qwen3", "Gemma 3"):
        assert family in msg
    for fmt in (".gguf", "safetensors", "fp32", "bf16", "int8", "int4", "gemma3-270m"):
        assert fmt in msg
    # a supported architecture passes the same check (the test can tell the two apart)
    check_model_name(str(write_gguf(tmp_path / "llama.gguf", "llama", arch_last=True)))
    check_model_name(str(write_gguf(tmp_path / "gemma.gguf", "gemma3")))


def test_unsupported_gguf_is_refused_before_any_hashing_or_conversion(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("LDQA_CACHE_DIR", str(cache))

    def no_hashing(*a, **k):
        raise AssertionError("the architecture must be checked before the file is hashed or converted")

    monkeypatch.setattr(model_sources, "file_sha256", no_hashing)
    path = write_gguf(tmp_path / "mamba.gguf", "mamba")
    for load in (load_model, loader.load_tokenizer):
        with pytest.raises(UnsupportedModelError, match="GGUF architecture 'mamba'"):
            load(str(path))
    assert not cache.exists()  # nothing converted, no metadata written


def test_unreadable_gguf_files_are_refused(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all" * 10)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(write_gguf(tmp_path / "whole.gguf", "llama", arch_last=True).read_bytes()[:60])
    for path, why in ((garbage, "not a GGUF file"), (empty, "not a GGUF file"), (cut, "truncated")):
        with pytest.raises(ModelLoadError, match=why) as e:
            check_model_name(str(path))
        assert str(path) in str(e.value)


def test_longdocqa_refuses_a_bad_model_at_construction(tmp_path):
    store = tmp_path / "store"
    with pytest.raises(UnsupportedModelError, match="'phi3'.*Gemma 3"):
        LongDocQA(store=store, model=str(write_gguf(tmp_path / "phi.gguf", "phi3")))
    with pytest.raises(ModelLoadError, match="not found"):
        LongDocQA(store=store, model=str(tmp_path / "missing.gguf"))
    (tmp_path / "notes.pdf").write_bytes(b"%PDF-1.4")  # there, but no model: said so, not "not found"
    with pytest.raises(ModelLoadError, match=r"is a \.pdf file, not a \.gguf file") as e:
        LongDocQA(store=store, model=str(tmp_path / "notes.pdf"))
    assert "not found" not in str(e.value)
    with pytest.raises(ModelLoadError, match="is a directory without config.json"):
        LongDocQA(store=store, model=str(tmp_path))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LongDocQA(store=store, model=str(garbage))


def test_longdocqa_refuses_a_bad_prefill_weights_setting_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("LDQA_PREFILL_WEIGHTS", "yes")
    with pytest.raises(ValueError, match=r"\$LDQA_PREFILL_WEIGHTS='yes'.*keep.*dequantize"):
        LongDocQA(store=tmp_path / "store")


@pytest.mark.parametrize("missing", [1, 100, 128])  # bytes cut from the end: the 4x8 fp32 tensor is 128
def test_a_gguf_cut_off_in_its_tensor_data_is_refused_with_the_sizes(tmp_path, monkeypatch, missing):
    whole = write_gguf(tmp_path / "whole.gguf", "llama", arch_last=True)
    data = whole.read_bytes()
    expected = loader.gguf_expected_size(whole)
    assert expected is not None and expected <= len(data)  # the writer may pad after the last tensor
    check_model_name(str(whole))  # the complete file passes: the test can tell the two apart
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:expected - missing])
    assert gguf_architecture(cut) == "llama"  # the header is intact

    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_sources, "file_sha256",
                        lambda *a, **k: pytest.fail("a truncated file must not be hashed"))
    for refuse in (check_model_name, load_model, loader.load_tokenizer,
                   lambda name: LongDocQA(store=tmp_path / "store", model=name)):
        with pytest.raises(ModelLoadError) as e:
            refuse(str(cut))
        msg = str(e.value)
        assert str(cut) in msg and "truncated" in msg and "download it again" in msg
        assert f"{expected:,} bytes" in msg and f"has {expected - missing:,} bytes" in msg
        assert f"{missing:,} missing" in msg


def test_hf_directories_are_checked_from_config_json(tmp_path, tiny_model_dir):
    phi = tmp_path / "phi"
    phi.mkdir()
    (phi / "config.json").write_text(json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    (phi / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError) as e:
        LongDocQA(store=tmp_path / "store", model=str(phi))
    assert "Phi3ForCausalLM" in str(e.value) and str(phi) in str(e.value) and "Qwen3" in str(e.value)
    assert "safetensors" in str(e.value) and "int8" in str(e.value)

    good = tiny_model_dir("qwen3")
    check_model_name(str(good))  # the real tiny directory passes
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(good / "config.json", no_weights)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        check_model_name(str(no_weights))
    (no_weights / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors cannot be read"):
        LongDocQA(store=tmp_path / "store", model=str(no_weights))
    (no_weights / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json cannot be read"):
        check_model_name(str(no_weights))


def test_with_model_refuses_an_unsupported_model(tmp_path, tiny_model_dir):
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")))
    with pytest.raises(UnsupportedModelError, match="'phi3'"):
        qa.with_model(str(write_gguf(tmp_path / "phi.gguf", "phi3")))


def _fake_ui(monkeypatch, calls, stop_after: float | None = None):
    """Replace the Gradio app and launch() with fakes: launch blocks until the app is closed (or, when
    `stop_after` is given, that many seconds, like a Ctrl-C)."""
    import ldqa.app.ui as ui

    class FakeApp:
        is_running = False

        def close(self, verbose=True):
            calls.append("close")
            self.is_running = False

    def build_app(qa, cfg=None):
        calls.append("build_app")
        return FakeApp()

    def launch(app, cfg, host="127.0.0.1", port=7860, auth=None, block=True):
        calls.append("launch")
        app.is_running = True
        t0 = time.monotonic()
        while app.is_running and time.monotonic() - t0 < (stop_after or 60):
            time.sleep(0.02)
        return "http://fake"

    monkeypatch.setattr(ui, "build_app", build_app)
    monkeypatch.setattr(ui, "launch", launch)


def test_serve_exits_before_listening_on_an_unsupported_model(tmp_path, monkeypatch, capsys):
    calls = []
    _fake_ui(monkeypatch, calls)
    path = write_gguf(tmp_path / "phi.gguf", "phi3")
    assert main(["serve", "--store", str(tmp_path / "store"), "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "ldqa serve: error:" in err and "'phi3'" in err and "Gemma 3" in err and "Traceback" not in err
    assert calls == []  # no app built, nothing launched


def test_serve_stops_and_exits_nonzero_when_the_background_load_fails(tmp_path, monkeypatch, capsys,
                                                                      tiny_model_dir):
    calls = []
    _fake_ui(monkeypatch, calls)

    def broken_warm_up(self):
        time.sleep(0.2)  # the page is up first
        raise ModelLoadError("cached weights /x/weights-int8.safetensors could not be read")

    monkeypatch.setattr(LongDocQA, "warm_up", broken_warm_up)
    argv = ["serve", "--store", str(tmp_path / "store"), "--model", str(tiny_model_dir("gemma3"))]
    t0 = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - t0 < 30  # closed by the failed load, not by launch's 60 s
    err = capsys.readouterr().err
    assert "server stopped" in err and "could not be read" in err
    assert calls == ["build_app", "launch", "close"]

    # a load that works leaves the server up until it is stopped, and the command exits 0
    calls.clear()
    _fake_ui(monkeypatch, calls, stop_after=1.0)
    monkeypatch.setattr(LongDocQA, "warm_up", lambda self: None)
    assert main(argv) == 0
    assert calls == ["build_app", "launch"]


# ------------------------------------------------------------------------------------------ item 7

def _nan_forward(monkeypatch, model, after_calls: int = 0, value=float("nan")):
    """model.forward returns non-finite logits from call number `after_calls` + 1 on (hidden states of
    a partial pass are left alone)."""
    real = model.forward
    calls = []

    def forward(*a, **k):
        out = real(*a, **k)
        calls.append(1)
        if k.get("n_layers") is None and len(calls) > after_calls:
            out = out.clone()
            out[..., 1] = value
        return out

    monkeypatch.setattr(model, "forward", forward)
    return calls


@pytest.mark.parametrize("after,where", [(0, "after the prefill of"), (3, "at decode step 3")])
def test_non_finite_logits_raise_naming_model_format_and_what_to_do(tiny_model_dir, monkeypatch, after, where):
    name = str(tiny_model_dir("llama"))
    lm = load_model(name, weights="fp32")
    ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode("The kiln dries oak boards")
    cfg = SamplingConfig(max_new_tokens=8)
    gen = start_generation(lm.model, ids, lm.tokenizer.decode, (), cfg)
    assert len(list(gen)) > 0 and gen.stats.generated_tokens == 8  # finite logits: no error

    _nan_forward(monkeypatch, lm.model, after, float("nan") if after else float("inf"))
    with pytest.raises(NonFiniteLogitsError) as e:
        list(start_generation(lm.model, ids, lm.tokenizer.decode, (), cfg))
    msg = str(e.value)
    assert where in msg and repr(name) in msg and "weights fp32" in msg and "NaN" in msg
    assert "'bf16' or 'int8'" in msg and "--weights bf16" in msg


def test_api_answer_raises_instead_of_returning_an_empty_answer(tmp_path, tiny_model_dir, monkeypatch):
    qa = LongDocQA(store=tmp_path / "store", model=str(tiny_model_dir("gemma3")), weights="int8", max_new_tokens=4)
    ans = qa.answer("How long does the kiln run?", PASSAGES)  # finite: an Answer, whatever its text
    assert ans.timings["generated_tokens"] >= 0
    _nan_forward(monkeypatch, qa.llm.model)
    with pytest.raises(NonFiniteLogitsError, match="weights int8.*non-finite logits"):
        qa.answer("How warm is the kiln?", PASSAGES)


def test_eval_records_a_nan_answer_as_an_error_row(tmp_path, tiny_model_dir, monkeypatch, capsys):
    model = str(tiny_model_dir("gemma3"))
    data = tmp_path / "two.jsonl"
    data.write_text("\n".join(json.dumps({"question": q, "answers": ["nine days"], "passages": PASSAGES})
                              for q in ("How long does drying take?", "POISON: how warm is it?")) + "\n")
    poisoned = threading.local()
    real_forward = Transformer.forward

    def forward(self, *a, **k):  # NaN logits while answering the poisoned question only
        out = real_forward(self, *a, **k)
        return out * float("nan") if getattr(poisoned, "on", False) and k.get("n_layers") is None else out

    real_answer = LongDocQA.answer

    def answer(self, question, *a, **k):
        poisoned.on = question.startswith("POISON")
        try:
            return real_answer(self, question, *a, **k)
        finally:
            poisoned.on = False

    monkeypatch.setattr(Transformer, "forward", forward)
    monkeypatch.setattr(LongDocQA, "answer", answer)
    out = tmp_path / "out"
    argv = ["eval", "jsonl", "--data", str(data), "--out", str(out), "--model", model, "--weights", "fp32",
            "--max-new-tokens", "4", "--no-progress"]
    assert main(argv) == 0
    assert "1 of 2 answers failed" in capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    rows = {r["question"][:6]: r for r in res["rows"]}
    bad, good = rows["POISON"], rows["How lo"]
    assert "non-finite logits" in bad["error"] and repr(model) in bad["error"]
    assert bad["score"] is None and bad["prediction"] == "" and bad["ttft_ms"] is None
    assert "error" not in good and isinstance(good["score"], float)
    assert res["errors"] == 1 and res["modes"][0]["errors"] == 1 and res["modes"][0]["n"] == 1
    assert res["modes"][0]["accuracy"] == good["score"]  # the error row is not a wrong answer
    with sqlite3.connect(str(out / "predictions.sqlite")) as db:  # not cached: a rerun answers it again
        assert db.execute("SELECT COUNT(*) FROM predictions").fetchone()[0] == 1


def test_float16_is_refused_with_the_reason(tmp_path, tiny_model_dir, monkeypatch):
    name = str(tiny_model_dir("gemma3"))
    for w in ("fp16", "float16"):
        with pytest.raises(WeightFormatError, match="65504.*use weights 'bf16'"):
            load_model(name, weights=w)
        with pytest.raises(WeightFormatError, match="Gemma 3"):
            LongDocQA(store=tmp_path / "store", model=name, weights=w)
    with pytest.raises(ValueError, match="kv_dtype 'fp16'.*use kv_dtype 'bf16'"):
        check_kv_dtype("fp16")
    monkeypatch.setenv("LDQA_WEIGHTS", "fp16")
    with pytest.raises(WeightFormatError, match="LDQA_WEIGHTS='fp16'.*65504"):
        default_weights()
    assert main(["ask", "q?", "--store", str(tmp_path / "s"), "--model", name]) == 2  # the CLI says so too


@pytest.mark.parametrize("family,why", [("gemma3", "Gemma 3's activations exceed float16's range"),
                                        ("llama", "computes in fp32/bf16 only")])
def test_a_model_cast_to_float16_is_refused_before_prefill(tiny_model_dir, family, why):
    lm = load_model(str(tiny_model_dir(family)), weights="fp32")
    half = copy.deepcopy(lm.model).half()
    ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode("The kiln")
    with pytest.raises(WeightFormatError) as e:
        start_generation(half, ids, lm.tokenizer.decode, (), SamplingConfig(max_new_tokens=2))
    assert why in str(e.value) and "float16" in str(e.value) and "'bf16'" in str(e.value)
    assert lm.model.model.norm.weight.dtype == torch.float32  # the loaded model itself is untouched
    start_generation(lm.model, ids, lm.tokenizer.decode, (), SamplingConfig(max_new_tokens=2))  # fp32 runs
