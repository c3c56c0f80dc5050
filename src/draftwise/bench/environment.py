"""What a benchmark was measured on: the machine, the libraries, the model's weights digest, and peak memory."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..backend.calibration.machine import bandwidth_floor, cpu_model


class PeakMemoryMeter:
    """Peak memory of one run, measured as honestly as the device allows.

    - CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak: tensors only (weights, caches,
      activations), not the allocator's reserve.
    - CPU on Linux: the resident set's high-water mark (``VmHWM``) after resetting it through
      ``/proc/self/clear_refs``: the whole process (weights, KV cache, drafter state, Python heap) at its highest
      during the run. Memory the process kept from earlier runs counts too, so differences between rows are what a
      row adds on top.
    - Elsewhere: the process's high-water mark since it started (``ru_maxrss``), which cannot be reset: the same
      for every run after the largest one.

    :attr:`kind` names which of these applies.
    """

    KINDS = {
        "cuda": "cuda max_memory_allocated per run",
        "vmhwm": "process RSS high-water mark per run (VmHWM)",
        "maxrss": "process RSS high-water mark since start (ru_maxrss)",
    }

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self._source = "cuda"
        else:
            self._source = "vmhwm" if self._reset_rss_peak() else "maxrss"

    @property
    def kind(self) -> str:
        """What :meth:`peak_bytes` measures here."""
        return self.KINDS[self._source]

    @staticmethod
    def _reset_rss_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # 5: reset the peak resident set size
            return True
        except OSError:
            return False

    def reset(self) -> None:
        """Start a new measurement."""
        if self._source == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._source == "vmhwm":
            self._reset_rss_peak()

    def peak_bytes(self) -> int | None:
        """The peak since :meth:`reset`, in bytes."""
        if self._source == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._source == "vmhwm":
            with open("/proc/self/status", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _sha256_of_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def model_digest(name_or_path: str) -> dict[str, str | None]:
    """A sha256 that identifies the model's weights, and what it is the digest of.

    Presets: the GGUF file's published digest. A GGUF file: its own digest. A checkpoint folder converted by
    draftwise: the digest of the GGUF it came from; any other folder: the digest of its weight files, in name order.
    """
    from ..models import PRESETS

    if name_or_path in PRESETS:
        return {"sha256": PRESETS[name_or_path].sha256, "sha256_of": "preset GGUF file"}
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return {"sha256": _sha256_of_files([path]), "sha256_of": "GGUF file"}
    marker = path / "draftwise.json"
    if marker.is_file():
        recorded = json.loads(marker.read_text()).get("gguf_sha256")
        if recorded:
            return {"sha256": recorded, "sha256_of": "source GGUF file"}
    weights = sorted(
        item for pattern in ("*.safetensors", "*.bin", "*.pt") for item in path.glob(pattern) if item.is_file()
    )
    if weights:
        return {"sha256": _sha256_of_files(weights), "sha256_of": "weight files " + ", ".join(p.name for p in weights)}
    return {"sha256": None, "sha256_of": None}


def _row_plan(model: Any) -> dict[str, Any] | None:
    """Whether the target's draft trees are exact here and why drafting is off where they are not, with how a lean
    target pads its products (see :mod:`draftwise.backend.calibration.invariance`)."""
    if getattr(model, "backend", None) != "lean":
        return {"exact_trees": getattr(model, "exact_trees", False),
                "drafting_off": getattr(model, "drafting_off_reason", None)}
    return {
        "drafting_off": model.drafting_off_reason,
        "linear_min_rows": model.linear_min_rows,
        "attention_min_rows": model.attention_min_rows,
        "exact_trees": model.exact_trees,
        "attention": model.attention_path,
        "huge_pages": model.huge_pages,
    }


def _draftwise_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("draftwise")
    except PackageNotFoundError:
        return "unknown"


def environment(
    model: Any,
    model_name: str,
    *,
    draft_model: Any = None,
    draft_model_name: str | None = None,
    memory: str | None = None,
) -> dict[str, Any]:
    """What the numbers were measured on: machine, libraries, model (and draft model) with weight digests."""
    import transformers

    digest = model_digest(model_name)
    env: dict[str, Any] = {
        "model": model_name,
        "model_sha256": digest["sha256"],
        "model_sha256_of": digest["sha256_of"],
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        # (the products' weights: a block quantisation, else the dtype's float weights)
        "weights": getattr(model, "quantization", None) or str(model.dtype).removeprefix("torch."),
        # (the precision of the quantised products' activations on the CPU kernels; None where there are none)
        "activation_bits": getattr(model, "kernel_activation_bits", None),
        # (what the caches keep keys and values in: the lean forward's, else the model's dtype)
        "kv_cache_dtype": str(getattr(model, "kv_dtype", model.dtype)).removeprefix("torch."),
        "backend": getattr(model, "backend", "transformers"),
        # (most positions a sequence may reach: the model's, or max_model_len where given)
        "context_length": getattr(model, "context_length", None),
        # (whether the GPU's step runs through torch.compile)
        "torch_compile": bool(getattr(model, "compiled", False)),
        "row_plan": _row_plan(model),
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "draftwise": _draftwise_version(),
        "peak_memory": memory or PeakMemoryMeter(model.device).kind,
        **bandwidth_floor(model),
    }
    if draft_model_name is not None:
        draft_digest = model_digest(draft_model_name)
        env.update(
            draft_model=draft_model_name,
            draft_model_sha256=draft_digest["sha256"],
            draft_model_dtype=str(draft_model.dtype).removeprefix("torch.") if draft_model is not None else None,
        )
    return env
