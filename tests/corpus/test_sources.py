"""Corpus sources (record shapes, files, folders, truncated ShareGPT arrays, benchmark refusal, tokenizing, prompt
files) and ``draftwise corpus build``."""

from __future__ import annotations

import gzip
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import CharTokenizer

import draftwise
from draftwise import cli
from draftwise.bench.prompts import spec_bench_path
from draftwise.corpus.selfgen import read_prompt_file
from draftwise.corpus.sources import (
    SHAREGPT_RESERVED_EVERY,
    check_not_benchmark,
    documents,
    documents_of_record,
    folder_files,
    read_text_file,
    recover_json_array,
    sharegpt_conversations,
    sharegpt_documents,
    source_documents,
    tokenize_documents,
)
from draftwise.drafters.stores.trigram import TrigramStore, pack_pair
from draftwise.errors import DraftwiseError, InvalidRequestError


class TextTokenizer(CharTokenizer):
    """A character tokenizer with the parts of the transformers interface a corpus build uses; it records the
    pieces it was asked to encode."""

    name_or_path = "text-chars"

    def __init__(self, vocab_size: int = 96) -> None:
        super().__init__(vocab_size)
        self.pieces: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.pieces.append(text)
        return self.encode_text(text)


def spec_bench_or_skip():
    return spec_bench_path()


# --------------------------------------------------------------------------------------------------- records


@pytest.mark.parametrize(
    "record, texts",
    [
        ("a bare string", ["a bare string"]),
        ({"text": "plain text"}, ["plain text"]),
        ({"content": "some content"}, ["some content"]),
        ({"prompt": "question?", "completion": "answer."}, ["question?", "answer."]),
        ({"prompt": "question?", "response": "reply.", "output": "out."}, ["question?", "reply.", "out."]),
        (
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "x"}]},
            ["be brief", "hi"],
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, "junk", {"value": 3}]},
            ["q", "a"],
        ),
        ({"turns": ["first turn", "second turn", 7]}, ["first turn", "second turn"]),
        ({"text": "kept", "prompt": "   ", "messages": None, "turns": None}, ["kept"]),
        ({"text": 5, "id": "no text here"}, []),
        (["a", "list"], []),
        (42, []),
        (None, []),
    ],
)
def test_documents_of_every_record_shape(record, texts):
    assert documents_of_record(record) == texts


# ----------------------------------------------------------------------------------------------------- files


def test_read_text_file_formats(tmp_path):
    text = tmp_path / "notes.md"
    text.write_text("# Title\n\nbody\n")
    assert list(read_text_file(text)) == ["# Title\n\nbody\n"]
    records = [{"text": "one"}, "two", {"messages": [{"role": "user", "content": "three"}]}]
    lines = "\n".join(json.dumps(record) for record in records) + "\n\n"
    plain = tmp_path / "records.jsonl"
    plain.write_text(lines)
    assert list(read_text_file(plain)) == ["one", "two", "three"]
    packed = tmp_path / "records.jsonl.gz"
    packed.write_bytes(gzip.compress(lines.encode()))
    assert list(read_text_file(packed)) == ["one", "two", "three"]
    binary = tmp_path / "image.txt"
    binary.write_bytes(b"\x89PNG\x00\x00binary")
    assert list(read_text_file(binary)) == []
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    assert list(read_text_file(blank)) == []
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(InvalidRequestError, match="broken.jsonl:2: not JSON"):
        list(read_text_file(broken))


def make_corpus_folder(root):
    """A folder of text files, a binary file and files of other kinds; returns the texts expected from it, in order."""
    root.mkdir()
    (root / "b.txt").write_text("bee text")
    (root / "a.md").write_text("a markdown text")
    (root / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "packed one"}\n{"text": "packed two"}\n'))
    (root / "d.txt").write_bytes(b"binary\x00content")
    (root / "e.png").write_bytes(b"not read")
    (root / "f.bin").write_text("not read either")
    (root / "sub").mkdir()
    (root / "sub" / "z.py").write_text("print('deep')\n")
    (root / "sub" / "nested").mkdir()
    (root / "sub" / "nested" / "y.rst").write_text("nested rst")
    return ["a markdown text", "bee text", "packed one", "packed two", "nested rst", "print('deep')\n"]


def test_folder_walk_order_and_binary_skipping(tmp_path):
    folder = tmp_path / "corpus"
    expected = make_corpus_folder(folder)
    files = [path.relative_to(folder).as_posix() for path in folder_files(folder)]
    assert files == ["a.md", "b.txt", "c.jsonl.gz", "d.txt", "sub/nested/y.rst", "sub/z.py"]
    assert list(source_documents(str(folder))) == expected
    assert list(source_documents(str(folder / "b.txt"))) == ["bee text"]
    assert list(documents([str(folder / "b.txt"), str(folder)])) == ["bee text", *expected]


def test_unknown_and_missing_sources_are_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="unknown source 'no-such-source'"):
        source_documents("no-such-source")
    with pytest.raises(InvalidRequestError, match="unknown source"):
        source_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(InvalidRequestError, match="no corpus sources"):
        list(documents([]))
    # Every spec is checked before the first document is read.
    good = tmp_path / "good.txt"
    good.write_text("good text")
    texts = documents([str(good), "no-such-source"])
    with pytest.raises(InvalidRequestError, match="unknown source"):
        next(texts)


def test_named_sources_yield_text():
    code = next(iter(source_documents("stdlib")))
    assert isinstance(code, str) and code.strip()


# -------------------------------------------------------------------------------------------- truncated JSON


RECORDS = [
    {"id": 0, "text": "commas, brackets ] and braces } inside strings"},
    {"id": 1, "nested": [1, [2, {"deep": "]"}]], "escaped": "quote \" and \\ backslash"},
    {"id": 2, "text": "unicode \u00e9\u4e2d"},
    {"id": 3},
]


def serialised_array(records) -> tuple[str, list[int]]:
    """The JSON text of an array of ``records`` and the offset where each record ends."""
    text, ends = "[\n  ", []
    for index, record in enumerate(records):
        if index:
            text += ",\n  "
        text += json.dumps(record, ensure_ascii=False)
        ends.append(len(text))
    return text + "\n]\n", ends


def test_recover_json_array_at_every_cut():
    text, ends = serialised_array(RECORDS)
    for cut in range(len(text) + 1):
        recovered = list(recover_json_array(text[:cut]))
        complete = sum(1 for end in ends if end <= cut)
        assert recovered == list(enumerate(RECORDS[:complete])), cut


def test_recover_json_array_edge_cases():
    assert list(recover_json_array("")) == []
    assert list(recover_json_array("no array here")) == []
    assert list(recover_json_array("[]")) == []
    assert list(recover_json_array('  [ {"a": 1} , {"b": 2} ]')) == [(0, {"a": 1}), (1, {"b": 2})]
    assert list(recover_json_array('[{"a": 1}, oops, {"b": 2}]')) == [(0, {"a": 1})]


def test_a_number_cut_short_is_not_a_record():
    assert list(recover_json_array("[1, 23")) == [(0, 1)]


def conversation(index: int) -> dict:
    return {
        "id": f"r{index}",
        "conversations": [{"from": "human", "value": f"question {index}"}, {"from": "gpt", "value": f"answer {index}"}],
    }


def test_sharegpt_skips_reserved_positions_of_a_truncated_file(tmp_path):
    text, ends = serialised_array([conversation(index) for index in range(25)])
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: ends[-1] - 20])  # cut inside the last record
    ids = [record["id"] for record in sharegpt_conversations(path)]
    assert ids == [f"r{index}" for index in range(24) if index % SHAREGPT_RESERVED_EVERY]
    assert "r0" not in ids and "r10" not in ids and "r20" not in ids and len(ids) == 21
    texts = list(sharegpt_documents(path))
    assert texts[:2] == ["question 1", "answer 1"] and len(texts) == 42
    assert "question 10" not in texts


# ------------------------------------------------------------------------------------------ benchmark refusal


def test_benchmark_data_is_refused(tmp_path):
    spec_bench = spec_bench_or_skip()
    for path in (spec_bench, spec_bench.parent, spec_bench.parent.parent):
        with pytest.raises(InvalidRequestError, match="benchmark prompts"):
            check_not_benchmark(path)
        with pytest.raises(InvalidRequestError, match="benchmark prompts"):
            source_documents(str(path))
    with pytest.raises(InvalidRequestError, match="benchmark prompts"):
        read_prompt_file(spec_bench)
    # A link to the benchmark inside an ordinary folder is followed, and refused.
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "fine.txt").write_text("fine")
    (folder / "questions.jsonl").symlink_to(spec_bench)
    with pytest.raises(InvalidRequestError, match="benchmark prompts"):
        list(source_documents(str(folder)))
    assert check_not_benchmark(folder / "fine.txt") == (folder / "fine.txt").resolve()


# ------------------------------------------------------------------------------------------------ tokenizing


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.text(alphabet="ab \n", max_size=40), max_size=5),
    st.one_of(st.none(), st.integers(0, 60)),
    st.integers(1, 12),
)
def test_tokenize_documents_bounds(texts, max_tokens, chunk_chars):
    tokenizer = TextTokenizer()
    arrays = list(tokenize_documents(tokenizer, texts, max_tokens=max_tokens, chunk_chars=chunk_chars))
    everything = [token for text in texts for token in tokenizer.encode_text(text)]
    expected = everything if max_tokens is None else everything[:max_tokens]
    assert [int(token) for ids in arrays for token in ids] == expected
    assert all(ids.dtype == np.int32 and len(ids) for ids in arrays)


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet="ab \n", max_size=60), st.integers(1, 12))
def test_long_documents_are_cut_at_line_ends(text, chunk_chars):
    tokenizer = TextTokenizer()
    list(tokenize_documents(tokenizer, [text], chunk_chars=chunk_chars))
    pieces = tokenizer.pieces
    assert "".join(pieces) == text
    assert all(0 < len(piece) <= chunk_chars for piece in pieces)
    start = 0
    for piece in pieces[:-1]:
        if "\n" in text[start + 1 : start + chunk_chars]:  # a line end inside the window: the cut is there
            assert piece.endswith("\n")
        start += len(piece)


def test_tokenize_documents_stops_reading_at_the_bound():
    endless = (f"document {index}\n" for index in itertools.count())
    arrays = list(tokenize_documents(TextTokenizer(), endless, max_tokens=100))
    assert sum(len(ids) for ids in arrays) == 100


# ----------------------------------------------------------------------------------------------- prompt files


def test_read_prompt_file_formats(tmp_path):
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\n\n  \nsecond prompt\n")
    assert read_prompt_file(lines) == ["first prompt", "second prompt"]
    messages = [{"role": "user", "content": "hello"}]
    records = tmp_path / "prompts.jsonl"
    records.write_text(
        "\n".join(
            json.dumps(record)
            for record in ({"prompt": "a prompt"}, {"messages": messages}, {"turns": ["turn one", "turn two"]})
        )
        + "\n\n"
    )
    assert read_prompt_file(records) == ["a prompt", messages, "turn one"]


def test_read_prompt_file_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.txt")
    with pytest.raises(InvalidRequestError, match="is a folder"):
        read_prompt_file(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(InvalidRequestError, match="holds no prompts"):
        read_prompt_file(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\nnot json\n')
    with pytest.raises(InvalidRequestError, match="broken.jsonl:2: not a prompt row"):
        read_prompt_file(broken)
    shapeless = tmp_path / "shapeless.jsonl"
    shapeless.write_text('{"prompt": "fine"}\n{"question": "?"}\n')
    with pytest.raises(InvalidRequestError, match="shapeless.jsonl:2: not a prompt row"):
        read_prompt_file(shapeless)


# ----------------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def tiny_cli(monkeypatch, tiny_llama):
    monkeypatch.setattr(cli.common, "load", lambda args, options=None: (tiny_llama, TextTokenizer()))


def ids(text: str) -> list[int]:
    return TextTokenizer().encode_text(text)


def test_cli_builds_a_tri_gram_store(tiny_cli, tiny_llama, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("abcd" * 50)
    (corpus / "b.jsonl").write_text('{"text": "xyz"}\n{"messages": [{"role": "user", "content": "pqrs"}]}\n')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abcabc\n")
    out = tmp_path / "store.npz"
    argv = ["corpus", "build", "--out", str(out), "--max-tokens", "1000", "--self-generate", str(prompts),
            "--max-new-tokens", "8", str(corpus)]
    assert cli.main(argv) == 0
    assert "215 tokens counted" in " ".join(capsys.readouterr().err.split())  # 8 answer tokens + 200 + 3 + 4
    store, metadata = TrigramStore.load(out)
    assert metadata == {"tokenizer": "text-chars", "tokens": "215"}
    a, b, c, d, x, y, z, p, q, r = ids("abcdxyzpqr")
    assert store.row(a, b) == ([c], [1.0]) and store.row(b, c) == ([d], [1.0])
    assert store.row(c, d) == ([a], [1.0])  # "d" then "x" would span two documents
    assert store.row(x, y) == ([z], [1.0]) and store.row(p, q) == ([r], [1.0])
    assert store.row(y, z) == ([], [])
    # Nothing spans documents: "d" is never followed by "x", and the pair (d, x) backs off to the bi-gram of x.
    assert store.row(z, d) == ([a], [1.0]) and store.row(d, x) == ([y], [1.0])
    assert pack_pair(d, x) not in store.keys.tolist()
    answer = draftwise.generate(tiny_llama, TextTokenizer(), "abcabc", method="ar", max_new_tokens=8).token_ids
    for first, second, third in zip(answer, answer[1:], answer[2:]):
        assert third in store.row(first, second)[0]


def test_cli_respects_the_token_bound_and_options(tiny_cli, tmp_path):
    corpus = tmp_path / "big.txt"
    corpus.write_text("".join(chr(0x100 + (index * 7) % 50) for index in range(3000)))
    out = tmp_path / "store.npz"
    argv = ["corpus", "build", "--out", str(out), "--max-tokens", "500", "--top-k", "2", "--max-pairs", "30",
            str(corpus)]
    assert cli.main(argv) == 0
    store, metadata = TrigramStore.load(out)
    assert metadata["tokens"] == "500"
    assert store.top_k == 2 and len(store) <= 30


def test_cli_refuses_bad_arguments(tiny_cli, tmp_path, capsys):
    out = tmp_path / "store.npz"
    good = tmp_path / "good.txt"
    good.write_text("some text")
    parser = cli.build_parser()
    bad = [
        ([], "at least one source"),
        (["--max-tokens", "0", str(good)], "must be positive"),
        (["--max-new-tokens", "0", str(good)], "must be positive"),
        (["--top-k", "0", str(good)], "must be positive"),
        (["--max-pairs", "-1", str(good)], "must be positive"),
        (["no-such-source"], "unknown source"),
        (["--self-generate", str(tmp_path / "missing.txt")], "does not exist"),
    ]
    spec_bench = spec_bench_path()
    bad += [
        ([str(spec_bench.parent)], "benchmark prompts"),
        ([str(good), "--self-generate", str(spec_bench)], "benchmark prompts"),
    ]
    for arguments, message in bad:
        args = parser.parse_args(["corpus", "build", "--out", str(out), *arguments])
        with pytest.raises(DraftwiseError, match=message):
            cli.corpus.run_corpus(args)
    assert cli.main(["corpus", "build", "--out", str(out)]) == 2
    assert "at least one source" in capsys.readouterr().err
    assert not out.exists()
