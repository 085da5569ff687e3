"""eval/bench/gpu_check.py without a GPU: it refuses (exit 2) unless --dry-run, which runs its end-to-end
part on the CPU with a tiny model and writes the JSON and the table; its byte tokenizer round-trips text."""

from __future__ import annotations

import json

import pytest
import torch

from ldqa.eval.bench import gpu_check

pytestmark = [pytest.mark.bench, pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")]


def test_refuses_without_cuda(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_dry_run_measures_the_runtime_end_to_end(tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    e = r["end_to_end"]
    assert e["device"] == "cpu" and e["rope_self_check"] and e["block_warm_kv_hits"] == 10
    assert e["prompt_tokens"] > 1300 and e["decode_tokens"] == 4
    assert all(e[k] > 0 for k in ("ttft_full_ms", "ttft_block_cold_ms", "ttft_block_warm_ms",
                                  "ttft_block_recompute_warm_ms", "decode_tokens_per_s"))
    assert e["logits_within_tolerance"] and 0 < e["logits_rel_diff"] <= gpu_check.LOGIT_TOL  # bf16 against fp32
    assert "ttft_block_warm_ms" in (tmp_path / "gpu_check.md").read_text()


def test_byte_tokenizer_round_trips():
    tok = gpu_check.byte_tokenizer()
    text = "Tighten to 18 Nm — naïve café, 表"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(tok) == 259 and tok.decode(ids) == text and max(ids) < 259
