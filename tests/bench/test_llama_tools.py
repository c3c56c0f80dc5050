"""llama.cpp's own speculation as bench rows (:mod:`draftwise.bench.llama_tools`): the rows' specs are checked, a run
without the built tool leaves them out and says how to build it, and the runner drives the tool's command line and
reads its timings and answer (a stand-in script here: building llama.cpp takes minutes)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from gguf_files import TINY_LLAMA, write_random_gguf

from draftwise import cli
from draftwise.bench import llama_tools, run
from draftwise.bench.llama_tools import DEFAULT_NGRAM_TYPE, LlamaToolRunner, ToolRow, tool_row
from draftwise.decoding.sampling import SamplingParams
from draftwise.errors import UnsupportedOptionError

#: A stand-in for llama-speculative-simple: echoes the prompt file and an answer, prints the tool's timing lines, and
#: keeps its arguments.
FAKE_TOOL = """#!/bin/sh
echo "$@" > "$(dirname "$0")/arguments.txt"
while [ $# -gt 0 ]; do
  if [ "$1" = "-f" ]; then prompt="$2"; fi
  shift
done
printf '\\n\\n'
head -c -1 "$prompt"
printf ' the answer\\n\\n'
echo "encoded   12 tokens in    0.250 seconds, speed:   48.000 t/s" >&2
echo "decoded    3 tokens in    0.500 seconds, speed:    6.000 t/s" >&2
echo "n_drafted = 4" >&2
echo "n_accept  = 2" >&2
"""


class Characters:
    """A tokenizer of one id per character."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(token) for token in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(character) for character in text]

    def __call__(self, text):
        return {"input_ids": self.encode(text)}


@pytest.fixture
def fake_tool(tmp_path):
    tool = tmp_path / "bin" / llama_tools.TOOL
    tool.parent.mkdir()
    tool.write_text(FAKE_TOOL)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool


def test_the_rows_specs_are_checked():
    assert tool_row("llama.cpp-draft:model=x") == "llama.cpp-draft" and tool_row("llama.cpp") is None
    assert ToolRow.parse("llama.cpp-draft:model=qwen,n_max=4,p_min=0.5") == ToolRow(
        "llama.cpp-draft", draft_model="qwen", n_max=4, p_min=0.5)
    assert ToolRow.parse("llama.cpp-ngram").ngram_type == DEFAULT_NGRAM_TYPE
    assert ToolRow.parse("llama.cpp-ngram:type=ngram-mod,n_max=8") == ToolRow("llama.cpp-ngram", ngram_type="ngram-mod",
                                                                              n_max=8)
    for bad in ("llama.cpp-draft", "llama.cpp-draft:model=x,width=2", "llama.cpp-ngram:type=lookahead",
                "llama.cpp-ngram:n_max=0", "llama.cpp-draft:model=x,p_min=2", "llama.cpp-ngram:n_max=many"):
        with pytest.raises(UnsupportedOptionError):
            ToolRow.parse(bad)
    with pytest.raises(UnsupportedOptionError, match="n_max"):
        run.validate_methods(["llama.cpp-ngram:n_max=0"])


def test_the_runner_drives_the_tool_and_reads_its_timings(fake_tool, tmp_path):
    runner = LlamaToolRunner(fake_tool, ToolRow.parse("llama.cpp-draft:model=d,n_max=6"), tmp_path / "t.gguf",
                             tmp_path / "d.gguf", Characters(), context=512, threads=2)
    prompt = "<|im_start|>user\nhi \\n<|im_end|>\n"  # (a backslash and a last newline, kept)
    measured = runner.measure(Characters().encode(prompt), 16, [], SamplingParams())
    assert Characters().decode(measured.token_ids) == " th"  # the answer, cut to the tokens it decoded
    assert measured.time_s == pytest.approx(0.75) and measured.time_to_first_token_s == pytest.approx(0.25)
    assert (runner.drafted, runner.accepted) == (4, 2)
    arguments = (fake_tool.parent / "arguments.txt").read_text().split()
    for flag, value in (("-m", str(tmp_path / "t.gguf")), ("-md", str(tmp_path / "d.gguf")), ("-n", "16"),
                        ("--temp", "0"), ("-t", "2"), ("-c", "512"), ("--spec-draft-n-max", "6"),
                        ("--spec-type", "draft-simple")):
        assert arguments[arguments.index(flag) + 1] == value
    assert "--no-escape" in arguments
    ngram = LlamaToolRunner(fake_tool, ToolRow.parse("llama.cpp-ngram:type=ngram-mod"), tmp_path / "t.gguf", None,
                            Characters(), context=512, threads=1)
    cut = ngram.measure([104, 105], 2, [], SamplingParams())  # three decoded, two asked for
    assert len(cut.token_ids) == 2 and cut.time_s == pytest.approx(0.25 + 0.5 * 2 / 3)
    arguments = (fake_tool.parent / "arguments.txt").read_text().split()
    assert arguments[arguments.index("--spec-type") + 1] == "ngram-mod" and "-md" not in arguments
    with pytest.raises(UnsupportedOptionError, match="greedily"):
        ngram.measure([104], 4, [], SamplingParams(temperature=0.7, seed=1))


def bench(gguf: Path, tmp_path: Path, methods: str, capsys) -> tuple[int, dict, str]:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "abcabcabc"}) + "\n")
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--model", str(gguf), "--methods", methods, "--data", str(data), "--max-new-tokens",
                     "4", "--no-chat-template", "--device", "cpu", "--threads", "1", "--cache-dir",
                     str(tmp_path / "cache"), "--json", str(out)])
    err = capsys.readouterr().err
    return code, json.loads(out.read_text()) if out.exists() else {}, err


def test_without_the_tool_the_bench_leaves_the_rows_out_and_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run, "find_tool", lambda cache_dir=None: None)
    gguf = write_random_gguf(tmp_path / "tiny.gguf", TINY_LLAMA, "Q8_0", head_type="Q8_0")
    code, written, err = bench(gguf, tmp_path, "ar,llama.cpp-ngram", capsys)
    assert code == 0, err
    assert "leaving out llama.cpp-ngram" in err and "python -m draftwise.bench.build_llama_tools" in err
    assert {record["method"] for record in written["records"]} == {"ar"}


def test_the_tool_rows_in_a_bench_run(tmp_path, capsys, monkeypatch, fake_tool):
    monkeypatch.setattr(run, "find_tool", lambda cache_dir=None: fake_tool)
    gguf = write_random_gguf(tmp_path / "tiny.gguf", TINY_LLAMA, "Q8_0", head_type="Q8_0")
    code, written, err = bench(gguf, tmp_path, f"ar,llama.cpp-ngram,llama.cpp-draft:model={gguf}", capsys)
    assert code == 0, err
    records = [record for record in written["records"] if record["method"] != "ar"]
    assert {record["method"] for record in records} == {"llama.cpp-ngram", f"llama.cpp-draft:model={gguf}"}
    assert all(record["time_s"] == pytest.approx(0.75) for record in records)


def test_a_build_without_cmake_or_llama_cpp_says_what_it_needs(tmp_path, monkeypatch):
    import importlib.util

    from draftwise.errors import InvalidRequestError

    if importlib.util.find_spec("llama_cpp") is None:
        with pytest.raises(InvalidRequestError, match=r"draftwise\[anchors\]"):
            llama_tools.build_tools(tmp_path, say=lambda line: None)
        return
    monkeypatch.setattr(llama_tools.shutil, "which", lambda name: None)
    with pytest.raises(InvalidRequestError, match="cmake"):
        llama_tools.build_tools(tmp_path, say=lambda line: None)
    assert not (tmp_path / "llama.cpp").exists()
