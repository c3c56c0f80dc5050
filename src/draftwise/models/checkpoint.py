"""Float weights: transformers checkpoint folders, and GGUF files converted once into one.

A checkpoint folder (one with a ``config.json``) is loaded in place. A GGUF file whose float weights are asked for (a
preset's, checked first, or any local ``.gguf`` file) is de-quantised once by transformers and saved as a plain
checkpoint in the cache folder, so later loads take about a second. Nothing is ever half-written: a failed
conversion leaves no checkpoint behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import DraftwiseError, ModelLoadError
from .presets import PRESETS, cache_folder, file_sha256, preset_gguf

#: The file a finished conversion (or a GGUF file's kept metadata) writes last.
MARKER = "draftwise.json"


def checkpoint_ready(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _convert_gguf(gguf_path: Path, destination: Path) -> None:
    """De-quantise a GGUF file with transformers and save it as a plain checkpoint in ``destination``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    except Exception as error:  # transformers raises many kinds on a bad file
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF model: {error}") from error
    # The weights are plain floats now; drop the GGUF quantizer so the checkpoint reloads as an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(destination))
    tokenizer.save_pretrained(str(destination))


def _converted(gguf_path: Path, folder: Path, record: dict[str, Any], progress: bool) -> Path:
    """``folder``, holding ``gguf_path`` converted to a plain checkpoint (converted now unless it already is)."""
    if checkpoint_ready(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".convert-") as scratch:
        if progress:
            print(f"converting {gguf_path.name} to a cached checkpoint in {folder} (once)", file=sys.stderr)
        staging = Path(scratch) / "checkpoint"
        _convert_gguf(gguf_path, staging)
        (staging / MARKER).write_text(json.dumps(record))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    return folder


def resolve_checkpoint(name_or_path: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The checkpoint folder for a preset name, a GGUF file or a checkpoint folder (converting once if needed)."""
    cache = cache_folder(cache_dir)
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        folder = cache / preset.name
        if checkpoint_ready(folder):
            return folder
        return _converted(preset_gguf(preset.name, cache_dir), folder,
                          {"name": preset.name, "gguf_sha256": preset.sha256}, progress)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model; give a GGUF file or a checkpoint folder")
        digest = file_sha256(path)
        return _converted(path, cache / f"gguf-{digest[:16]}", {"name": path.name, "gguf_sha256": digest}, progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a transformers checkpoint folder")
        return path
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}), a GGUF file or a checkpoint folder"
    )


def checkpoint_model(folder: Path, dtype: torch.dtype) -> Any:
    """The transformers model of checkpoint ``folder`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except Exception as error:
        raise ModelLoadError(
            f"could not load the checkpoint in {folder}: {error}. If it is a cached conversion, delete that folder "
            "and load again to rebuild it"
        ) from error


def folder_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder``; ``None`` where it holds none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception:
        return None


@contextlib.contextmanager
def load_errors(source: Path, what: str) -> Iterator[None]:
    """Errors from reading ``source`` (a ``what``: "GGUF model", "model") as :class:`ModelLoadError`; the library's
    own errors pass as they are."""
    try:
        yield
    except ValueError as error:
        raise ModelLoadError(f"{source}: {error}") from None
    except DraftwiseError:
        raise
    except Exception as error:  # the gguf package raises many kinds on a damaged file
        raise ModelLoadError(f"{source} is not a readable {what}: {type(error).__name__}: {error}") from error
