"""The llama.cpp rows of the benchmark (:mod:`draftwise.bench.anchors`), on a small random-weight GGUF file written in
the test: which file each row runs (the very file the target runs, or the file's matrices rewritten once at the
target's float width, values and metadata kept), llama.cpp's runner and the rows in a bench run. Where
llama-cpp-python is absent, its tests skip with that reason and the rows refuse with the install command."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
from gguf_files import TINY_LLAMA, write_random_gguf

from draftwise import cli
from draftwise.bench.anchors import ANCHOR_ROWS, GGUF_TYPES, LlamaCppRunner, anchor_gguf, rewrite_gguf, source_gguf
from draftwise.decoding.sampling import SamplingParams
from draftwise.errors import InvalidRequestError

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (pip install 'draftwise[anchors]')")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", TINY_LLAMA, "Q8_0", head_type="Q8_0")


def test_the_source_file_is_the_gguf_itself_and_a_folder_is_refused(gguf_file, tmp_path):
    assert source_gguf(str(gguf_file)) == gguf_file
    with pytest.raises(InvalidRequestError, match="neither a preset nor a .gguf file"):
        source_gguf(str(tmp_path))


@pytest.mark.parametrize("dtype", list(GGUF_TYPES))
def test_a_rewrite_keeps_the_values_at_the_targets_width_and_the_metadata(gguf_file, tmp_path, dtype):
    import gguf

    destination = rewrite_gguf(gguf_file, tmp_path / "rewritten.gguf", dtype)
    source, rewritten = gguf.GGUFReader(str(gguf_file)), gguf.GGUFReader(str(destination))
    type_name, file_type = GGUF_TYPES[dtype]
    assert rewritten.fields["general.file_type"].contents() == file_type
    for name in ("general.architecture", "tokenizer.ggml.tokens", "llama.block_count", "llama.context_length"):
        assert rewritten.fields[name].contents() == source.fields[name].contents()
    tensors = {tensor.name: tensor for tensor in rewritten.tensors}
    assert set(tensors) == {tensor.name for tensor in source.tensors}
    for tensor in source.tensors:
        original = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        new = tensors[tensor.name]
        values = gguf.quants.dequantize(new.data, new.tensor_type).astype(np.float32)
        assert values.shape == original.shape
        if original.ndim == 1:  # (norms stay float32, as llama.cpp keeps them)
            assert new.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(values, original)
            continue
        assert new.tensor_type == getattr(gguf.GGMLQuantizationType, type_name)
        expected = torch.from_numpy(original).to(dtype).float().numpy()
        assert np.array_equal(values, expected), tensor.name  # rounded once to the width, no other change


def test_the_rewritten_file_is_kept_and_reused(gguf_file, tmp_path):
    first = anchor_gguf(str(gguf_file), torch.bfloat16, tmp_path)
    written = first.stat().st_mtime_ns
    assert anchor_gguf(str(gguf_file), torch.bfloat16, tmp_path) == first and first.stat().st_mtime_ns == written
    assert anchor_gguf(str(gguf_file), torch.float16, tmp_path) != first
    assert not list(first.parent.glob(".*.tmp")), "no scratch file is left"


def test_without_llama_cpp_the_rows_say_how_to_install_it(gguf_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # (an import of it now fails, installed or not)
    with pytest.raises(InvalidRequestError, match=r"pip install 'draftwise\[anchors\]'"):
        LlamaCppRunner(gguf_file, lookup=False, context=256)


@needs_llama_cpp
def test_the_runner_decodes_token_ids_greedily_with_and_without_lookup(gguf_file):
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 30, 31, 32]
    plain = LlamaCppRunner(gguf_file, lookup=False, context=256, threads=1)
    first = plain.measure(prompt, 12, eos=[], sampling=SamplingParams())
    again = plain.measure(prompt, 12, eos=[], sampling=SamplingParams())
    assert len(first.token_ids) == 12 and first.token_ids == again.token_ids  # (each run pays its own prefill)
    assert 0 < first.time_to_first_token_s <= first.time_s
    lookup = LlamaCppRunner(gguf_file, lookup=True, context=256, threads=1)
    assert lookup.measure(prompt, 12, eos=[], sampling=SamplingParams()).token_ids == first.token_ids
    stopped = plain.measure(prompt, 12, eos=[first.token_ids[3]], sampling=SamplingParams())
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(first.token_ids[3]) + 1]


@needs_llama_cpp
def test_the_llama_cpp_rows_in_a_bench_run(gguf_file, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("abcabcabc", "ab ab ab ab")))
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--model", str(gguf_file), "--methods", "ar," + ",".join(ANCHOR_ROWS), "--data",
                     str(data), "--max-new-tokens", "6", "--no-chat-template", "--device", "cpu", "--threads", "1",
                     "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    written = json.loads(out.read_text())
    assert written["settings"]["anchor_gguf"] == gguf_file.name  # the very file the target runs, as shipped
    rows = {record["method"] for record in written["records"]}
    assert rows == {"ar", *ANCHOR_ROWS}
    for record in written["records"]:
        assert 0 < record["new_tokens"] <= 6 and record["time_s"] > 0
