"""How a model is loaded: one typed object, checked once, that every caller builds and passes on.

:class:`LoadOptions` holds every option of :func:`draftwise.load_model`: the command line builds one from its model
flags, the benchmark keeps one in its settings and records it, a Ray Serve replica is given one; each checks nothing
itself. Its defaults are the library's, so the command line, the Python API, the benchmark and the server agree.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..backend.calibration.machine import auto_dtype
from ..backend.forward.lean import KV_CACHE_DTYPES, named_kv_cache_dtype
from ..backend.weights.quantized import check_activation_bits
from ..errors import ModelLoadError, UnsupportedModelError

#: Float dtypes a model can be loaded in (``"auto"``: bfloat16 where the device computes it natively, else float32).
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Forwards a model can run through: the engine's own (``lean``), the model's public one (``transformers``), or the
#: lean one where it can run the model (``auto``).
BACKENDS = ("auto", "lean", "transformers")
#: What a model's linear products can run with: ``"file"`` a GGUF file's own block quantisations (as shipped),
#: ``"q8_0"``/``"q4_0"`` quantised on load, ``"float"`` the float weights in the dtype.
WEIGHTS = ("file", "q8_0", "q4_0", "float")
#: Cache dtypes ``kv_cache_dtype`` can name besides ``"auto"``.
KV_CACHE_CHOICES = ("auto", *KV_CACHE_DTYPES)


def check_compile_device(device: torch.device) -> None:
    """Refuse ``torch_compile`` on ``device`` unless it is a CUDA device (it compiles the GPU's fixed-shape step)."""
    if device.type != "cuda":
        raise ModelLoadError("torch_compile compiles the GPU's fixed-shape step: it needs a CUDA device (on CPUs the "
                             f"lean forward runs kernels built for the machine), not {device}")


def default_device() -> str:
    """The device ``device="auto"`` loads on: the first CUDA device where there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class LoadOptions:
    """Every option of loading a model, checked when the object is made (a bad value raises
    :class:`~draftwise.errors.ModelLoadError` naming the choices). Options that depend on the model itself (whether
    the lean forward runs it, whether it is a GGUF file) are checked when it loads.

    Attributes:
        dtype: ``"auto"`` (bfloat16 on a GPU or a CPU with native bf16, float32 otherwise; float32 where quantised
            weights run), ``"float32"``, ``"bfloat16"`` or ``"float16"`` (a ``torch.dtype`` is taken by name).
        device: ``"auto"`` (the first CUDA device where there is one, else the CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:1"``...
        backend: which forward runs the model (:data:`BACKENDS`).
        weights: ``"file"``: a GGUF file's (or preset's) block-quantised matrices as shipped; ``"q8_0"``/``"q4_0"``:
            the linear products' weights quantised on load; ``"float"``: the float weights in ``dtype``. ``None``:
            ``"file"`` for a GGUF file or preset on a CPU the compiled kernels run on, unless a dtype is asked for,
            ``"float"`` otherwise (:func:`draftwise.models.default_weights`).
        activation_bits: with quantised weights on the compiled CPU kernels, the precision each row's activations are
            quantised to, 16 (per group of 32 inputs) or 8 (per group of 32, per 128 inputs over k-quants); ``None``: the model's
            (:func:`draftwise.models.default_activation_bits`).
        kv_cache_dtype: what the lean forward's caches keep keys and values in: ``"auto"`` (float16 beside quantised
            weights on the compiled CPU kernels, as llama.cpp's cache; the model's dtype otherwise) or a dtype name
            (a ``torch.dtype`` is taken by name).
        max_model_len: most positions a sequence may reach, prompt and output together (vLLM's option); ``None``: the
            model's context length.
        torch_compile: on a CUDA device, run the lean forward's fixed-shape step through ``torch.compile``.
        cache_dir: where converted checkpoints, packed weights and this machine's measurements are kept (``None``:
            ``~/.cache/draftwise``).
        fast_linear: for the transformers backend on CPUs, the few-row product kernels.
        calibrate: measure on this machine (or recall) what makes verification rows exact and the forward's cost by
            rows.
    """

    dtype: str = "auto"
    device: str = "auto"
    backend: str = "auto"
    weights: str | None = None
    activation_bits: int | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    torch_compile: bool = False
    cache_dir: str | None = None
    fast_linear: bool = True
    calibrate: bool = True

    def __post_init__(self) -> None:
        def normalise(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if isinstance(self.dtype, torch.dtype):
            normalise("dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in DTYPES:
            raise ModelLoadError(f"unknown dtype {self.dtype!r}: use {', '.join(DTYPES)}")
        if isinstance(self.device, torch.device):
            normalise("device", str(self.device))
        if not isinstance(self.device, str):
            raise ModelLoadError(f"device must be a name such as cpu, cuda or cuda:1, not {self.device!r}")
        if self.device != "auto":
            try:
                normalise("device", str(torch.device(self.device)))
            except RuntimeError as error:
                raise ModelLoadError(f"unknown device {self.device!r}: {error}") from None
        if self.backend not in BACKENDS:
            raise ModelLoadError(f"unknown backend {self.backend!r}; backends: {', '.join(BACKENDS)}")
        if self.weights is not None and self.weights not in WEIGHTS:
            raise ModelLoadError(f"unknown weights {self.weights!r}; weights: {', '.join(WEIGHTS)}")
        if self.activation_bits is not None:
            try:
                check_activation_bits(self.activation_bits)
            except ValueError as error:
                raise ModelLoadError(str(error)) from None
        if self.kv_cache_dtype is None:
            normalise("kv_cache_dtype", "auto")
        try:
            kv_dtype = named_kv_cache_dtype(self.kv_cache_dtype)
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
        normalise("kv_cache_dtype", "auto" if kv_dtype is None else str(kv_dtype).removeprefix("torch."))
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ModelLoadError(f"max_model_len must be a positive whole number, not {self.max_model_len!r}")
        for name in ("torch_compile", "fast_linear", "calibrate"):
            if not isinstance(getattr(self, name), bool):
                raise ModelLoadError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if self.cache_dir is not None:
            normalise("cache_dir", os.fspath(self.cache_dir))
        if self.backend == "transformers" and self.weights not in (None, "float"):
            raise UnsupportedModelError(f"{self.weights} weights run on the lean backend, not transformers'")
        if self.torch_compile:
            if self.backend == "transformers":
                raise ModelLoadError("torch_compile compiles the lean forward's step, not the transformers backend's")
            if self.device != "auto":
                check_compile_device(torch.device(self.device))

    @classmethod
    def of(cls, options: LoadOptions | None = None, **changes: Any) -> LoadOptions:
        """``options`` (default: the defaults) with ``changes`` (option names as keywords), checked."""
        base = options if options is not None else cls()
        if not isinstance(base, LoadOptions):
            raise ModelLoadError(f"options must be draftwise.LoadOptions, not {type(base).__name__}")
        unknown = sorted(set(changes) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise ModelLoadError(f"unknown load option {', '.join(map(repr, unknown))}; options: "
                                 f"{', '.join(field.name for field in dataclasses.fields(cls))}")
        return dataclasses.replace(base, **changes) if changes else base

    def replace(self, **changes: Any) -> LoadOptions:
        """A copy with ``changes``, checked."""
        return LoadOptions.of(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The options as JSON-ready values (what a benchmark records)."""
        return dataclasses.asdict(self)

    @property
    def resolved_device(self) -> torch.device:
        """The device the model loads on (``"auto"`` decided now)."""
        device = torch.device(default_device() if self.device == "auto" else self.device)
        if self.torch_compile:
            check_compile_device(device)
        return device

    def resolved_dtype(self, quantized: bool) -> torch.dtype:
        """The dtype the model loads in: ``"auto"`` is float32 beside quantised weights (their products take float32
        activations), else bfloat16 where the device computes it natively, else float32."""
        if self.dtype == "auto":
            return torch.float32 if quantized else auto_dtype(self.resolved_device)
        return getattr(torch, self.dtype)
