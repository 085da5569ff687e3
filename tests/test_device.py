"""The `device` option on a machine without CUDA: names checked, "auto" resolving to the CPU, a CUDA
device refused with a message that says what to use, each device's default weights and KV dtype, the
device recorded in `Answer.settings` and kept out of the CPU's eval cache keys. What runs on CUDA itself
is tests/test_gpu.py (the `gpu` group) and tests/test_kernels_runtime.py (the kernel path, interpreted)."""

from __future__ import annotations

import sys

import pytest
import torch

from ldqa.attention.device import (check_device, check_weights_on, default_kv_dtype, device_kind,
                                   resolve_device)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_names(name):
    assert check_device(name) == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "", None, "mps"])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(ValueError, match="use auto"):
        check_device(name)


def test_auto_is_the_cpu_without_cuda():
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_says_what_to_use(name):
    with pytest.raises(ValueError, match=r"device 'cuda.*use device 'cpu' or 'auto'"):
        resolve_device(name)


def test_each_device_defaults():
    from ldqa.attention.loader import default_weights

    assert default_kv_dtype("cpu") == "fp32" and default_kv_dtype("cuda:1") == "bf16"
    assert device_kind("cuda:1") == "cuda"
    assert default_weights("gemma3-270m", "cuda") == "bf16"
    assert default_weights("gemma3-270m", "cpu") == "gguf"
    assert check_weights_on("gguf", "cpu") == "gguf" and check_weights_on("fp32", "cuda") == "fp32"
    with pytest.raises(ValueError, match="'gguf' run on the CPU's kernels.*'bf16' or 'fp32'"):
        check_weights_on("gguf", "cuda")


def test_a_format_from_the_environment_is_named_as_such(monkeypatch):
    monkeypatch.setenv("LDQA_WEIGHTS", "q8_0")
    with pytest.raises(ValueError, match=r"'q8_0' \(from \$LDQA_WEIGHTS\) run on the CPU's kernels"):
        check_weights_on("q8_0", "cuda")


def test_the_device_module_and_the_cli_flag_need_no_torch():
    import subprocess

    code = ("import sys; from ldqa.app.cli import build_parser; "
            "a = build_parser().parse_args(['ask', 'q', '--device', 'cuda:1']); "
            "assert a.device == 'cuda:1' and a.kv_dtype is None, a; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_bad_device_flag_exits_2_naming_it(capsys):
    from ldqa.app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["ask", "q", "--device", "gpu"])
    assert e.value.code == 2 and "device 'gpu'" in capsys.readouterr().err


def test_settings_record_the_device(tiny_model_dir, tmp_path):
    from ldqa.app.api import LongDocQA, Passage

    qa = LongDocQA(store=tmp_path / "s", model=str(tiny_model_dir("qwen2")), weights="fp32", device="auto")
    assert (qa.device, qa.kv_dtype) == ("cpu", "fp32")
    a = qa.answer("Which code?", [Passage("Notes", "The fault shows code E-14.")], max_new_tokens=3)
    assert a.settings.device == "cpu" and a.settings.to_dict()["device"] == "cpu"
    assert qa.llm.device == "cpu" and qa.llm.model.device.type == "cpu"


def test_longdocqa_refuses_cuda_without_a_gpu(tmp_path):
    from ldqa.app.api import LongDocQA

    with pytest.raises(ValueError, match="no CUDA|has no CUDA support"):
        LongDocQA(store=tmp_path / "s", model="smollm2-135m", device="cuda")


def test_the_eval_cache_key_of_the_cpu_is_unchanged_and_cuda_has_its_own(tmp_path):
    from ldqa.eval.harness import EvalConfig, settings_hash

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = EvalConfig(benchmark="jsonl", data=str(data))
    cpu = settings_hash(cfg, "fp", 32)
    assert settings_hash(cfg, "fp", 32, None, "cpu", "fp32") == cpu
    cuda = settings_hash(cfg, "fp", 32, None, "cuda", "bf16")
    assert cuda != cpu and settings_hash(cfg, "fp", 32, None, "cuda:1", "bf16") == cuda
