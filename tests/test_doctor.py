"""``draftwise doctor`` (:mod:`draftwise.doctor`): what this machine does with a model, measured afresh, on a tiny
checkpoint saved in the test: the forward that runs it, its padding, whether its verification rows are bitwise plain
decoding's (and where not, the rows that differ), its cost by rows; the kept measurements left alone."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny_model

from draftwise import cli
from draftwise.doctor import as_rows, diagnose, flags_summary
from draftwise.models import LoadOptions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", seed=0).save_pretrained(str(folder))
    return folder


def test_the_lean_forward_is_diagnosed_exact_in_each_dtype(checkpoint, tmp_path):
    options = LoadOptions(device="cpu", cache_dir=str(tmp_path / "cache"))
    diagnosis = diagnose(str(checkpoint), ["float32", "bfloat16", "float32"], options, trials=3)
    assert [item.dtype for item in diagnosis.dtypes] == ["float32", "bfloat16"]  # (each dtype once)
    assert diagnosis.threads == torch.get_num_threads() and diagnosis.torch == torch.__version__
    for item in diagnosis.dtypes:
        assert item.backend == "lean" and item.exact_trees
        assert item.report.rows_checked > 0 and not item.report.mismatches
        assert item.linear_min_rows >= 1 and item.attention_min_rows >= 1
        assert {1, 8} <= set(item.cost_ms) and all(ms > 0 for ms in item.cost_ms.values())
    rows = as_rows(diagnosis)
    assert [row["dtype"] for row in rows] == ["float32", "bfloat16"]
    assert all(row["exact trees"].startswith("yes (") for row in rows)
    assert not (tmp_path / "cache" / "machine").exists(), "doctor measures afresh and keeps nothing"


def test_the_transformers_backend_is_diagnosed_by_its_own_rows(checkpoint, tmp_path):
    options = LoadOptions(device="cpu", backend="transformers", cache_dir=str(tmp_path / "cache"))
    diagnosis = diagnose(str(checkpoint), ["float32"], options, trials=3)
    (item,) = diagnosis.dtypes
    assert item.backend == "transformers" and item.linear_min_rows is None
    assert item.exact_trees == item.report.exact
    assert item.exact_trees == (not item.report.mismatches)
    row = as_rows(diagnosis)[0]
    assert row["exact trees"].startswith("yes" if item.exact_trees else "NO (")


def test_the_command_prints_the_machine_and_a_row_per_dtype(checkpoint, tmp_path, capsys):
    code = cli.main(["doctor", "--model", str(checkpoint), "--dtype", "float32,bfloat16", "--trials", "2",
                     "--device", "cpu", "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "machine:" in out and flags_summary().split(",")[0] in out
    assert "float32" in out and "bfloat16" in out and "yes (" in out


def test_quantised_weights_are_diagnosed_beside_the_bandwidth_floor(tmp_path, capsys):
    from gguf_files import TINY_QWEN, write_random_gguf

    from draftwise.backend import native

    if native.load_kernels(warn=False) is None:
        pytest.skip("the kernels cannot be built here")
    gguf = write_random_gguf(tmp_path / "tiny.gguf", TINY_QWEN, "Q4_K")
    options = LoadOptions(device="cpu", weights="file", activation_bits=8, cache_dir=str(tmp_path / "cache"))
    (item,) = diagnose(str(gguf), ["auto"], options, trials=2).dtypes
    assert item.dtype == "float32" and item.weights == "file" and item.exact_trees
    assert item.quantization.startswith("q4_k") and item.quantization.endswith("8-bit activations")
    assert item.floor_ms > 0
    row = as_rows(Diagnosis_of(item))[0]
    assert row["1 row vs floor"].endswith("ms)") and row["4/8/16 rows vs 1"].count("x") == 3
    code = cli.main(["doctor", "--model", str(gguf), "--trials", "2", "--device", "cpu", "--cache-dir",
                     str(tmp_path / "cache")])  # a GGUF file's own blocks unless told
    out = capsys.readouterr().out
    assert code == 0 and "q4_k" in out and "floor" in out


def Diagnosis_of(item):
    from draftwise.doctor import Diagnosis

    return Diagnosis("m", "cpu", False, "float32", torch.__version__, 1, [item])


@pytest.mark.parametrize("arguments, message", [
    (["--weights", "q8_0", "--dtype", "bfloat16"], "run float32 activations"),
    (["--dtype", "float32,int4"], "unknown dtype 'int4'"),
    (["--trials", "0"], "--trials"),
])
def test_the_command_refuses_what_it_cannot_measure(checkpoint, tmp_path, capsys, arguments, message):
    assert cli.main(["doctor", "--model", str(checkpoint), "--cache-dir", str(tmp_path), *arguments]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
