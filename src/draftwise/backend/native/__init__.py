"""Kernels compiled on the running machine, for the lean forward on CPUs.

:func:`ragged_attention` is one layer's attention for every row of a verification forward (lone rows, chains, tree
nodes, of any number of sequences) in one call that reads each sequence's cache in place. The library path it
replaces (:mod:`draftwise.backend.forward.attention`) spends about 28 small operations per layer on what is a few
thousand multiply-adds per row, and concatenates the caches of a batch at every layer. :func:`rms_norm`,
:func:`rotate_queries_keys` and :func:`silu_mul` do the forward's row-wise steps in one call each, where torch
takes three to eight operations whose fixed cost outweighs their arithmetic at a few rows. ``blocked_linear``
(float32 and bfloat16 on CPUs with AVX2 and FMA or AVX-512, bfloat16 there with avx512_bf16; see
:mod:`draftwise.backend.weights.products`) is the linear
products over weights packed once by ``pack_blocked_weight``; :func:`top_tokens` ranks the rows of logits (the
greedy token, the top predictions some drafters keep) and :func:`sampling_probabilities` gives each row's
sampling distribution (temperature, top-k, top-p and min-p by selection, not by sorting the vocabulary). Every
kernel computes a row from that row alone, in an order fixed by its position and width, so a row's bits never
depend on the call's size.

The extension is built from its sources with the machine's compiler the first time it is needed (a few minutes on two
cores, through :mod:`torch.utils.cpp_extension`, saying so as it goes) with ``-march=native``, and kept under
``~/.cache/draftwise/native`` keyed by the sources' contents, the flags, torch's and Python's versions and the CPU's
flags, so a machine with other vector units builds its own and two checkouts of the same sources share one build;
a build killed mid-way leaves nothing that blocks the next (:mod:`.build`). The
sources build for x86 CPUs with or without AVX, AVX2 or AVX-512, and for aarch64: x86 intrinsics sit behind the
macros of the vector units they need, each with a portable fallback. Where the extension cannot be built (no
compiler), :func:`load_kernels` says why and the lean forward keeps the library path, which is as exact, only
slower.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..calibration.machine import cache_root
from . import build
from .build import ExtensionBuild

FOLDER = Path(__file__).parent
#: The extension's sources (the Python module is defined in module.cpp).
SOURCES = tuple(sorted(FOLDER.glob("*.cpp")))
HEADERS = tuple(sorted(FOLDER.glob("*.h")))
#: Compiler flags: the machine's own vector units, and no contraction of products and sums into fused multiply-adds,
#: so that every inlined copy of the arithmetic (one per head group size, rows alone or several at once) rounds alike.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")


@cache
def extension_build() -> ExtensionBuild:
    """The kernels' build: their sources and flags, kept under ``~/.cache/draftwise/native``."""
    return ExtensionBuild("draftwise_native", SOURCES, HEADERS, CFLAGS, cache_root() / "native", "draftwise's kernels")


@cache
def build_key() -> str:
    """What a build depends on (:attr:`~draftwise.backend.native.build.ExtensionBuild.key`): the sources' contents,
    the flags, torch's and Python's versions and the CPU's flags."""
    return extension_build().key


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's builder runs ``ninja`` by name: where the machine has none, the one the ``ninja`` package installs
    into the environment (its folder is put on ``PATH`` for the build only)."""
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja
    except ImportError:
        yield
        return
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, previous]) if previous else ninja.BIN_DIR
    try:
        yield
    finally:
        os.environ["PATH"] = previous


@cache
def _load() -> tuple[Any | None, str | None]:
    try:
        with _ninja_on_path():
            module = build.load_extension(extension_build())
    except Exception as error:  # noqa: BLE001 (no compiler, no ninja, a failed build: the library path stays)
        lines = str(error).strip().splitlines()
        return None, f"{type(error).__name__}: {lines[-1] if lines else ''}"
    return module, None


def load_kernels(warn: bool = True) -> Any | None:
    """The compiled module (built on first use), or ``None`` where it cannot be built (with
    a warning saying why, once, when ``warn``)."""
    module, reason = _load()
    if module is None and warn and not _warned:
        _warned.append(True)
        warnings.warn(f"draftwise's kernels could not be built ({reason}); the lean forward uses its library "
                      "path (exact, slower)", RuntimeWarning, stacklevel=2)
    return module


_warned: list[bool] = []


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used here (``None`` when it can)."""
    return _load()[1]


def ragged_attention(
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    layer: int,
    row_sequence: torch.Tensor,
    row_committed: torch.Tensor,
    path_offsets: torch.Tensor,
    path_rows: torch.Tensor,
) -> torch.Tensor:
    """Attention of every row of a forward over its own keys, each row bitwise the same whatever else the forward
    holds (see the source's notes).

    Args:
        query: ``(rows, heads, head_dim)``, scaled and rotated, contiguous.
        new_keys, new_values: ``(rows, kv_heads, head_dim)``: this forward's rows' keys and values, in the caches'
            dtype.
        key_caches, value_caches: each sequence's whole cache, ``(layers, blocks, kv_heads, block, head_dim)``, in
            the query's dtype or in float16 beside a float32 query (widened exactly to float32 as they are read).
        layer: the layer whose cache is read.
        row_sequence: ``(rows,)`` int64, the sequence (index into the caches) of each row.
        row_committed: ``(rows,)`` int64, its sequence's committed positions (read from the cache).
        path_offsets: ``(rows + 1,)`` int64; ``path_rows[path_offsets[r]:path_offsets[r + 1]]`` are the rows of
            this forward on row ``r``'s path (its ancestors, then itself), in position order.

    Returns:
        ``(rows, heads * head_dim)`` in the query's dtype.
    """
    return _module().ragged_attention(query, new_keys, new_values, key_caches, value_caches, layer, row_sequence,
                                   row_committed, path_offsets, path_rows)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, min_rows: int = 1) -> torch.Tensor:
    """RMSNorm of every row of ``hidden`` ``(rows, dim)`` (transformers' order: normalised in float32, cast to the
    dtype, then weighted), returned with at least ``min_rows`` rows (the extra ones zero)."""
    return _module().rms_norm(hidden, weight, eps, min_rows)


def silu_mul(gate_up: torch.Tensor, rows: int, min_rows: int = 1) -> torch.Tensor:
    """``silu(gate) * up`` of the first ``rows`` rows of ``gate_up`` ``(rows', 2 * width)`` (gate columns first),
    computed in float32 and rounded once, returned with at least ``min_rows`` rows (the extra ones zero)."""
    return _module().silu_mul(gate_up, rows, min_rows)


def rotate_queries_keys(
    qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rows: int, heads: int, kv_heads: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of the first ``rows`` rows of the fused projections ``qkv`` ``(rows', (heads + 2 *
    kv_heads) * dim)``: queries times ``scale`` ``(rows, heads, dim)`` and keys ``(rows, kv_heads, dim)``.
    ``cos`` and ``signed_sin`` ``(rows, dim)`` are each row's position's (``signed_sin``'s first half negated)."""
    return _module().rotate_queries_keys(qkv, cos, signed_sin, rows, heads, kv_heads, scale)


def top_tokens(logits: torch.Tensor, k: int) -> torch.Tensor | None:
    """The indices of the ``k`` largest values of each row of ``logits`` ``(rows, width)`` (a CPU tensor in
    float32, bfloat16 or float16), best first, ties to the lower index; ``None`` where that is not computed here:
    the kernels not loaded in this process (never built for it), ``k`` past 64 or the width, another dtype or
    layout, or a row holding NaN."""
    module = _loaded()
    if (module is None or logits.device.type != "cpu" or logits.dim() != 2 or not 1 <= k <= min(64, logits.shape[1])
            or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    indices, ranked = module.top_tokens(logits if logits.stride(1) == 1 else logits.contiguous(), k)
    return indices if ranked else None


def sampling_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor | None:
    """Each row's sampling distribution, float32 ``(rows, width)``: ``logits`` divided by ``temperature``, cut by
    top-k (0 = off), top-p (1 = off) and min-p (0 = off) with transformers' semantics and order, then normalised.
    ``None`` where that is not computed here: a tensor off the CPU or of another dtype or layout, or no kernels on
    this machine. On a CPU the kernels are built if needed rather than skipped, so that every distribution of a
    process comes from the same code (plain decoding's and verification's rows agree bitwise)."""
    if (logits.device.type != "cpu" or logits.dim() != 2
            or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    module = load_kernels(warn=False)
    if module is None:
        return None
    return module.sampling_probabilities(logits if logits.stride(1) == 1 else logits.contiguous(), float(temperature),
                                         int(top_k), float(top_p), float(min_p))


def _loaded() -> Any | None:
    """The compiled module where this process has already loaded it (a caller that merely could use it never
    starts a build)."""
    return _load()[0] if _load.cache_info().currsize else None


def _module() -> Any:
    module = load_kernels(warn=False)
    if module is None:
        raise RuntimeError(f"draftwise's kernels are not available here: {unavailable_reason()}")
    return module
