"""Bad input, everywhere a command reads a file a user names: prompt files, corpora and corpus sources, datastores,
drafter state files, results files and GGUF models. Each kind of bad file (binary, empty, truncated, another
format) ends in one line on standard error naming the file and what is wrong with it, exit code 2, no traceback and
nothing written."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest
from gguf_files import TINY_LLAMA, write_random_gguf
from tiny import TextTokenizer

from draftwise import cli

BINARY = bytes(range(256)) * 8


def _npz_bytes(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _bad_files(kind: str) -> dict[str, bytes]:
    """The bad versions of a ``kind`` of file, by name: binary, empty, truncated, another format."""
    prompt_rows = "\n".join(json.dumps({"prompt": f"question {index}"}) for index in range(3)) + "\n"
    if kind == "jsonl":
        return {"binary": BINARY, "empty": b"", "truncated": prompt_rows.encode()[:-9] + b"\n",
                "another format": b"id,prompt\n1,hello\n", "not utf-8": "caf\u00e9".encode("latin-1") + b"\n"}
    if kind == "npz":
        whole = _npz_bytes(a=np.arange(1000), b=np.ones((30, 30)))
        return {"binary": BINARY, "empty": b"", "truncated": whole[: len(whole) // 2],
                "another format": _npz_bytes(something=np.arange(4)), "text": b"not an archive\n"}
    raise ValueError(kind)


def _error_line(captured) -> str:
    """The command's one error line (and proof that nothing else went wrong loudly)."""
    assert "Traceback" not in captured.err, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("draftwise: error:")]
    assert len(lines) == 1, captured.err
    return lines[0]


def _files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file()) if folder.exists() else []


@pytest.fixture
def tiny_load(monkeypatch, tiny_llama):
    """Commands load the tiny llama model (with a text tokenizer) instead of a real one; the loads are counted."""
    loaded = []

    def load(args, options=None):
        loaded.append(args.model)
        return tiny_llama, TextTokenizer()

    monkeypatch.setattr(cli.common, "load", load)
    return loaded


def _check(capsys, code: int, path: Path, *, written: list[Path] = ()) -> str:
    assert code == 2
    line = _error_line(capsys.readouterr())
    assert str(path) in line, line
    for output in written:
        assert not output.exists(), f"{output} was written"
    return line


@pytest.mark.parametrize("name", list(_bad_files("jsonl")))
def test_bench_prompt_file(tiny_load, tmp_path, capsys, name):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(_bad_files("jsonl")[name])
    out = tmp_path / "out.json"
    code = cli.main(["bench", "--methods", "ar", "--data", str(path), "--json", str(out), "--max-new-tokens", "4"])
    _check(capsys, code, path, written=[out])
    assert not tiny_load, "the prompts are read before the model loads"


@pytest.mark.parametrize("name", ["binary", "empty", "not utf-8"])
def test_generate_prompt_file(tiny_load, tmp_path, capsys, name):
    path = tmp_path / "prompt.txt"
    path.write_bytes(_bad_files("jsonl")[name])
    state = tmp_path / "state.npz"
    code = cli.main(["generate", "--prompt-file", str(path), "--method", "recycling", "--state", str(state)])
    _check(capsys, code, path, written=[state])


@pytest.mark.parametrize("name", list(_bad_files("jsonl")))
def test_self_generation_prompt_file(tiny_load, tmp_path, capsys, name):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(_bad_files("jsonl")[name])
    out = tmp_path / "corpus.npz"
    code = cli.main(["corpus", "build", "--out", str(out), "--self-generate", str(path)])
    _check(capsys, code, path, written=[out])
    assert not tiny_load


@pytest.mark.parametrize("name", ["binary", "empty", "truncated gzip", "not json lines"])
def test_corpus_source_file(tiny_load, tmp_path, capsys, name):
    text = ("a corpus document with words " * 50).encode()
    files = {"binary": ("source.txt", BINARY), "empty": ("source.txt", b""),
             "truncated gzip": ("source.txt.gz", gzip.compress(text)[:40]),
             "not json lines": ("source.jsonl", b"{\"text\": \"one\"}\n{\"text\": \n")}
    file_name, data = files[name]
    path = tmp_path / file_name
    path.write_bytes(data)
    for command in ("corpus", "datastore"):
        out = tmp_path / f"{command}.npz"
        code = cli.main([command, "build", "--out", str(out), str(path)])
        _check(capsys, code, path, written=[out])


@pytest.mark.parametrize("name", list(_bad_files("npz")))
@pytest.mark.parametrize("method", ["aded:corpus", "rest:datastore"])
def test_corpus_and_datastore_files(tiny_load, tmp_path, capsys, name, method):
    path = tmp_path / "store.npz"
    path.write_bytes(_bad_files("npz")[name])
    code = cli.main(["generate", "hello", "--method", f"{method}={path}"])
    _check(capsys, code, path)
    assert not tiny_load, "the drafter's file is read before the model loads"


@pytest.mark.parametrize("name", list(_bad_files("npz")))
@pytest.mark.parametrize("method", ["recycling", "aded"])
def test_drafter_state_file(tiny_load, tmp_path, capsys, name, method):
    path = tmp_path / "state.npz"
    data = _bad_files("npz")[name]
    path.write_bytes(data)
    code = cli.main(["generate", "hello", "--method", method, "--state", str(path)])
    _check(capsys, code, path)
    assert path.read_bytes() == data, "a state file that could not be read is left as it was"
    assert not tiny_load


@pytest.mark.parametrize("name", ["binary", "empty", "truncated", "another format"])
def test_results_file(tmp_path, capsys, name):
    header = json.dumps({"format": "draftwise-bench-results", "settings": {}}) + "\n"
    files = {"binary": BINARY, "empty": b"", "truncated": header.encode()[:25] + b"\n{\"method\": 1}\n",
             "another format": b"{\"some\": \"json\"}\n"}
    path = tmp_path / "runs.jsonl"
    path.write_bytes(files[name])
    out = tmp_path / "report"
    _check(capsys, cli.main(["report", str(path), "--out", str(out)]), path, written=[out])


@pytest.mark.parametrize("name", ["binary", "empty", "truncated", "another format"])
def test_loadtest_files(tmp_path, capsys, name):
    files = {"binary": BINARY, "empty": b"", "truncated": b"{\"label\": \"x\", \"levels\": [", "another format": b"[1, 2]"}
    path = tmp_path / "levels.json"
    path.write_bytes(files[name])
    _check(capsys, cli.main(["loadtest", "--no-run", "--compare", str(path)]), path)
    prompts = tmp_path / "questions.jsonl"
    prompts.write_bytes(_bad_files("jsonl")["binary" if name == "another format" else name])
    out = tmp_path / "out.json"
    code = cli.main(["loadtest", "--url", "http://127.0.0.1:9/v1", "--data-file", str(prompts), "--json", str(out)])
    _check(capsys, code, prompts, written=[out])


@pytest.mark.parametrize("name", ["binary", "empty", "truncated", "text"])
def test_gguf_model_file(tmp_path, capsys, name):
    good = write_random_gguf(tmp_path / "good.gguf", TINY_LLAMA, "Q8_0").read_bytes()
    files = {"binary": BINARY, "empty": b"", "truncated": good[: len(good) // 3], "text": b"hello, not a model\n"}
    path = tmp_path / "model.gguf"
    path.write_bytes(files[name])
    cache = tmp_path / "cache"
    code = cli.main(["generate", "hello", "--model", str(path), "--cache-dir", str(cache), "--max-new-tokens", "2"])
    _check(capsys, code, path)
    assert _files_under(cache) == []


def test_a_prediction_file_that_is_binary_a_folder_or_missing(tiny_load, tmp_path, capsys):
    binary = tmp_path / "prediction.txt"
    binary.write_bytes(BINARY)
    for path in (binary, tmp_path, tmp_path / "missing.txt"):
        _check(capsys, cli.main(["generate", "hello", "--prediction-file", str(path)]), path)


def test_a_good_prediction_file_is_drafted(tiny_load, tmp_path, capsys):
    path = tmp_path / "prediction.txt"
    path.write_text("hello world, hello world")
    assert cli.main(["generate", "hello", "--prediction-file", str(path), "--max-new-tokens", "8", "--stats"]) == 0
    stats = json.loads(capsys.readouterr().err)
    assert stats["accepted_prediction_tokens"] + stats["rejected_prediction_tokens"] > 0


def test_a_prompt_file_that_is_a_folder_or_missing(tiny_load, tmp_path, capsys):
    for path in (tmp_path, tmp_path / "missing.jsonl"):
        _check(capsys, cli.main(["bench", "--methods", "ar", "--data", str(path)]), path)
        _check(capsys, cli.main(["generate", "--prompt-file", str(path)]), path)

