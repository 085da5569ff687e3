"""The refactor guard's comparison (`ldqa.eval.bench.api_snapshot.differences`); recording needs the real model
and runs as `python -m ldqa.eval.bench.api_snapshot check docs/data/api-snapshot-gemma3-270m.json`."""

import copy
import json
from pathlib import Path

import pytest

from ldqa.eval.bench.api_snapshot import MODES, differences

pytestmark = pytest.mark.bench

SNAPSHOT = Path(__file__).resolve().parents[1] / "docs" / "data" / "api-snapshot-gemma3-270m.json"


def test_committed_snapshot_covers_every_mode():
    snap = json.loads(SNAPSHOT.read_text())
    assert {(a["attention"], a["debias"]) for a in snap["answers"]} == set(MODES)
    assert len(snap["answers"]) == len(MODES) * len(snap["questions"])


def test_differences_name_what_changed():
    snap = json.loads(SNAPSHOT.read_text())
    assert differences(snap, copy.deepcopy(snap)) == []
    other = copy.deepcopy(snap)
    other["answers"][3]["text"] += "!"
    other["answers"][5]["settings"]["new_key"] = 1
    del other["answers"][7]["settings"]["attention"]
    other["answers"][9]["timings_keys"] = other["answers"][9]["timings_keys"][1:]
    d = differences(snap, other)
    assert len(d) == 4
    assert "text" in d[0] and "new_key" in d[1] and "settings['attention']" in d[2] and "timings_keys" in d[3]
