"""Presets' defaults: the activation precision a model's file takes unless told otherwise."""

from __future__ import annotations

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
