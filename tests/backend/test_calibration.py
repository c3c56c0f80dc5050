"""Per-machine measurements are keyed by the code that made them: a digest of the backend's sources, stamped on every
record; records of other code are pruned once stale."""

from __future__ import annotations

import json
import os
import time

import torch

from draftwise.backend.calibration import machine
from draftwise.backend.calibration.machine import MeasurementStore, code_digest, machine_key


def test_the_digest_follows_every_source_and_nothing_else(tmp_path):
    (tmp_path / "native").mkdir()
    (tmp_path / "forward.py").write_text("x = 1\n")
    (tmp_path / "native" / "kernel.cpp").write_text("int f();\n")
    first = code_digest.__wrapped__(tmp_path)
    (tmp_path / "notes.txt").write_text("not a source")
    assert code_digest.__wrapped__(tmp_path) == first
    (tmp_path / "native" / "kernel.cpp").write_text("int f(int);\n")
    assert code_digest.__wrapped__(tmp_path) != first


def test_keys_change_with_the_code(monkeypatch):
    shape = {"layers": 2}
    before = machine_key("cpu", torch.float32, shape)
    monkeypatch.setattr(machine, "code_digest", lambda: "another")
    assert machine_key("cpu", torch.float32, shape) != before


def test_records_are_stamped_and_other_codes_stale_records_pruned(tmp_path):
    store = MeasurementStore(tmp_path)
    old = time.time() - 2 * MeasurementStore.STALE_AFTER_S
    (tmp_path / "stale-other.json").write_text(json.dumps({"code": "another", "row_plan": {}}))
    (tmp_path / "stale-unstamped.json").write_text(json.dumps({"row_plan": {"version": 5}}))
    (tmp_path / "fresh-other.json").write_text(json.dumps({"code": "another"}))
    (tmp_path / "stale-current.json").write_text(json.dumps({"code": code_digest()}))
    for name in ("stale-other", "stale-unstamped", "stale-current"):
        os.utime(tmp_path / f"{name}.json", (old, old))
    store.save("mine", {"row_plan": {"exact": True}})
    assert store.load("mine") == {"row_plan": {"exact": True}, "code": code_digest()}
    left = sorted(path.stem for path in tmp_path.glob("*.json"))
    # Another checkout's records in use stay; the current code's stay; stale others (and unstamped ones) go.
    assert left == ["fresh-other", "mine", "stale-current"]
