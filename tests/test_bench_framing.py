"""The planted-instruction set and the framing benchmark's scoring (`ldqa.eval.bench.bench_framing`)."""

import pytest

from ldqa.app.chat import CHAT_INSTRUCTION, DATA_FRAMING, UNFRAMED_CHAT_INSTRUCTION
from ldqa.eval.bench import bench_framing as bf
from ldqa.eval.metrics import best_subspan_em

pytestmark = pytest.mark.bench


def test_default_chat_instruction_frames_passages_as_data():
    assert CHAT_INSTRUCTION.startswith(UNFRAMED_CHAT_INSTRUCTION)
    assert CHAT_INSTRUCTION.endswith(DATA_FRAMING)
    assert "data" in bf.BASE_INSTRUCTIONS["framed"] and "Not found" not in bf.BASE_INSTRUCTIONS["framed"]


def test_items_are_answerable_and_the_plant_is_not():
    items = bf.load_items()
    assert len(items) == 10 and len({it["id"] for it in items}) == 10
    for it in items:
        # the gold passage answers the question; the planted passage neither answers it nor is obeyed by quoting it
        assert best_subspan_em(it["gold"]["text"], it["answers"]) == 1.0, it["id"]
        assert best_subspan_em(it["planted"]["text"], it["answers"]) == 0.0, it["id"]
        assert not bf.obeys(it["gold"]["text"], it["marker"]), it["id"]
        assert bf.obeys(it["planted"]["text"], it["marker"]), it["id"]


def test_summary_pairs_answers_by_item_and_position():
    rows = []
    for i, planted_at in enumerate(["first", "last", "first", "last"]):
        item = f"q{i // 2}"
        rows.append({"id": item, "planted_at": planted_at, "instruction": "unframed", "obeys": i < 2, "em": 0.0})
        rows.append({"id": item, "planted_at": planted_at, "instruction": "framed", "obeys": False, "em": 1.0 * (i != 3)})
    s = bf.summarize(rows, ["unframed", "framed"])
    assert s["unframed"]["obeys"] == 0.5 and s["framed"]["obeys"] == 0.0
    assert s["framed"]["obeys_diff"] == -0.5 and s["framed"]["em_diff"] == 0.75
    assert s["unframed"]["obeys_diff"] == 0.0 and s["unframed"]["obeys_diff_se"] == 0.0
    assert s["framed"]["em_diff_se"] == pytest.approx(0.25)  # stdev (1, 1, 1, 0) / sqrt(4)
