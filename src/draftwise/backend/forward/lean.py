"""The engine's own forward for llama- and qwen2-family models, written for verification.

transformers stays the loader and the reference: the weights are taken from its model once (query, key and value
projections fused into one product, gate and up projections into another; packed for oneDNN on CPUs), and its
forward is what the tests compare against. What this forward adds:

- **rows of any tree in one pass**, each with its own position and ancestors (:mod:`draftwise.backend.forward.attention`);
- **a static KV cache per sequence** (preallocated buffers; a step writes its rows after the committed length and
  only the accepted rows are compacted into place, so a rejected draft costs nothing);
- **batch invariance**: every row of a verification forward is bitwise what plain one-row decoding computes at the
  same position, in every dtype, because every product runs at a row count the machine's kernels are invariant at
  and attention is computed in position-aligned blocks (:mod:`draftwise.backend.calibration.invariance` measures both);
- **few operations per layer**, so a one-row step is close to the cost of reading the weights: on CPUs attention runs
  through a kernel compiled on the machine (:mod:`draftwise.backend.native`), one call per layer for every row of
  every sequence, each row's arithmetic fixed by its position alone; where it cannot be built, through the library
  path of :mod:`draftwise.backend.forward.attention`. The linear products run through the same module's blocked kernel
  where the CPU has AVX2 and FMA or AVX-512 (float32 and bfloat16), through oneDNN otherwise
  (:mod:`draftwise.backend.weights.products`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import UnsupportedModelError
from ..cache import LeanCache, check_full_attention
from ..rows import RowBlock, is_chain
from ..target import ForwardOutput, Target, last_rows_only
from ..weights.fusing import LeanLayer, all_products, fuse_layer, place_in_huge_pages
from ..weights.products import Linear, packing_available
from ..weights.quantized import (BLOCK_INPUTS, DequantizedLinear, MatrixSource, QuantizedLinear, QuantizedMatrix,
                                 check_activation_bits, decode, fits_dequantized, packed_product, quantization_name,
                                 quantize)
from ..weights.quantized import KINDS as QUANTIZATIONS
from .attention import (
    RaggedLayout,
    batch_block_attention,
    batch_layout,
    block_attention,
    causal_attention,
    ragged_layout,
    rows_attention,
    rows_layout,
    single_row_attention,
    tail_layout,
)

#: Most rows stacked into one product (16 sequences of 32 draft nodes): the linear products' invariance is checked
#: up to this many rows (:mod:`~draftwise.backend.calibration.invariance`), and a bigger batch runs as several forwards.
MAX_FORWARD_ROWS = 528

#: Model families this forward implements.
FAMILIES = ("llama", "qwen2")
#: Positions per attention block (see :mod:`draftwise.backend.forward.attention`); the compiled attention kernel is built for
#: this size (``kCacheBlock`` in ``native/ragged_attention.cpp``, checked at every call).
BLOCK = 64
#: The cache dtypes ``kv_cache_dtype`` names (besides ``"auto"``).
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16")


def named_kv_cache_dtype(asked: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype a ``kv_cache_dtype`` asks for (a name or a dtype); ``None`` for ``None`` and ``"auto"`` (the
    forward's choice, see :class:`LeanTarget`). Raises ValueError where it names no cache dtype."""
    if asked is None or asked == "auto":
        return None
    name = str(asked).removeprefix("torch.") if isinstance(asked, torch.dtype) else asked
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}: use auto or one of {', '.join(KV_CACHE_DTYPES)}")
    return getattr(torch, name)
#: Most prompt rows in one forward of a prefill with the compiled kernels (within :data:`MAX_FORWARD_ROWS`, up to
#: which products are checked to keep every row's bits).
PREFILL_PIECE = 512


@dataclass(frozen=True)
class LayerSkip:
    """Sub-layers a layer-skipping draft leaves out: layer indices whose attention, and whose MLP, is skipped."""

    attention: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.attention) + len(self.mlp)


#: The forward paths of this module, by :meth:`LeanTarget.forward_path` (prefills: :meth:`LeanTarget.prefill`; CUDA
#: devices run :class:`~draftwise.backend.forward.graphed.GraphedLeanTarget` instead, fixed-row steps (64 rows in
#: 16-bit dtypes, 16 in float32) replayed as CUDA graphs, one sequence at a time):
#:
#: ============  ==========================================  =====================================================
#: path          runs for                                     attention, and the layers
#: ============  ==========================================  =====================================================
#: ``kernel``    CPUs with the compiled kernels: every         ``ragged_attention``, every row of every sequence in
#:               forward (one row, chains, trees, batches)     one call a layer; the layers as one compiled loop
#:                                                             (``DecoderLayers``) where every product is blocked
#:                                                             and no layer is skipped
#: ``one-row``   library path: one sequence, one row           :func:`single_row_attention` over the cache in place
#: ``tree``      library path: one sequence's tree             :func:`block_attention` over the blocks paths reach
#: ``grouped``   library path: a chain, or several sequences   one set of products per group (lone rows, chains,
#:                                                             trees by row count): :func:`rows_attention` and
#:                                                             :func:`batch_block_attention`
#: prefill       kernel: the prompt as chains of at most       library: causal attention over the prompt
#:               :data:`PREFILL_PIECE` verification rows
#: ============  ==========================================  =====================================================
FORWARD_PATHS = ("kernel", "one-row", "tree", "grouped")


@dataclass(frozen=True)
class Attention:
    """How one forward's attention runs at every layer.

    Attributes:
        attend: ``attend(layer, queries, keys, values)``: every sequence's attention given all new rows' queries,
            keys and values (one sequence after the other); returns the rows' outputs in the same order.
        deferred: sequences (by index) whose attention takes this forward's rows from ``keys`` and ``values``:
            their caches are written once, after the last layer.
        layout: every row as the compiled attention reads it (the ``kernel`` path), else ``None``.
    """

    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    deferred: frozenset[int] = frozenset()
    layout: RaggedLayout | None = None


def _row_bucket(rows: int) -> int:
    """Sequences whose row counts share a bucket (1, 2, 3-4, 5-8, ...) run their attention in one set of products."""
    return 1 << max(0, rows - 1).bit_length()


def _bucket_members(sizes: Sequence[int], chains: Sequence[bool]) -> list[list[int]]:
    """Sequences (by index) grouped for their attention, smallest group first: lone rows together, every longer
    chain together (padded to the longest), trees (whose attention runs another way) by :func:`_row_bucket` of their
    row counts.

    Each group costs a whole set of products and their bookkeeping at every layer, which at these sizes weighs more
    than the padding: eight sequences with chains of 1, 1, 1, 1, 2, 3, 5 and 9 rows took 98-125 ms a forward in
    four groups by row bucket and 88-105 ms in two. Lone rows stay apart, as padding them to a long chain costs more
    than their group (seven lone rows beside a 16-row chain: 74-77 ms apart, 114 ms padded)."""
    keys = [(min(size, 2), False) if chain else (_row_bucket(size), True) for size, chain in zip(sizes, chains)]
    return [[index for index, key in enumerate(keys) if key == group] for group in sorted(set(keys))]


def row_groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive sequences grouped so that each group's rows stay within ``limit`` (a sequence bigger than
    ``limit`` alone in its group)."""
    groups: list[list[int]] = []
    rows = 0
    for index, size in enumerate(sizes):
        if not groups or rows + size > limit:
            groups.append([])
            rows = 0
        groups[-1].append(index)
        rows += size
    return groups


def model_device(model: Any) -> torch.device:
    """Where ``model``'s forward runs: the device of its first parameter that holds values (a GGUF file's model keeps
    its quantised matrices on ``meta``; the CPU where every parameter is there)."""
    for parameter in model.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return torch.device("cpu")


def unsupported_reason(model: Any) -> str | None:
    """Why the lean forward cannot run ``model`` (``None`` when it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} (the lean forward runs {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        return f"rope type {rope_type!r}"
    try:
        check_full_attention(model)
    except UnsupportedModelError as error:
        return str(error)
    return None


def rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


class LeanTarget(Target):
    """A llama- or qwen2-family model run by the engine's own forward (see the module docstring).

    Args:
        model: the transformers model whose weights are used (it stays the reference), or one without its
            quantised matrices (see below).
        linear_min_rows: products are padded to at least this many rows (measured by
            :func:`draftwise.backend.calibration.invariance.plan_rows`; 1 until then).
        attention_min_rows: the same for attention's products.
        packed: pack weights for oneDNN (default: where available).
        kernel: run attention and the row-wise steps (RMSNorm, rotary embedding, SiLU gating) through the compiled
            kernels (:mod:`draftwise.backend.native`): ``None`` (default) where it can (on CPUs, where they build;
            the library path otherwise, with a warning), ``True`` to insist (an error where it cannot), ``False``
            for the library path (torch operations; attention by :mod:`draftwise.backend.forward.attention`).
        huge_pages: keep the products' weights in transparent huge pages where the system gives them (CPUs; see
            :mod:`draftwise.backend.weights.pages`); :attr:`huge_pages` says whether they are.
        linear_fixed: run every linear product at exactly ``linear_min_rows`` rows (the CUDA forward's fixed step
            shape, see :mod:`draftwise.backend.forward.graphed`); such a target has no row plan to measure.
        quantization: ``"q8_0"`` or ``"q4_0"`` to keep every linear product's weights (the output head's too) in that
            GGUF block quantisation (:mod:`draftwise.backend.weights.quantized`; a float32 model on the compiled CPU
            kernels); ``None`` keeps the model's float weights.
        quantized: block-quantised matrices as a GGUF file holds them, by the model's projection module (the output
            head's module included) they replace (:func:`draftwise.backend.weights.gguf_file.file_matrices`, or a
            :class:`~draftwise.backend.weights.quantized.MatrixSource` of products packed before): each
            product whose projections all have one runs on them (the others keep their float weights). Each
            matrix must dequantise to exactly the module's weight: the model is then the float reference the
            quantised forward is compared with. Not with ``quantization``.
        embedding: the token embedding's rows by id where ``model`` does not hold its table in float (a GGUF file's
            blocks, :func:`draftwise.backend.weights.gguf_file.file_embedding`).
        activation_bits: the precision block-quantised products on the compiled kernels take each row's activations
            in: 16 (the default: within about 1e-4 of the float forward with a float32 cache) or 8 (llama.cpp's:
            half the integer multiplies); see :class:`~draftwise.backend.weights.quantized.QuantizedLinear`. Products
            dequantised per call (GPUs) take float activations whatever this says (see :attr:`kernel_activation_bits`).
        kv_cache_dtype: what the caches keep keys and values in (:attr:`kv_dtype`): ``None`` (the default) float16
            where block-quantised products run on the compiled kernels (float32 activations; llama.cpp's default
            cache too), the model's dtype otherwise; or a dtype (name): the model's, or float16 beside float32
            activations on the compiled kernels. Keys and values are rounded to it as the forward makes them, so a
            row's attention reads the same values from this forward's rows as from the cache: verification rows stay
            bitwise plain decoding's. (float16 holds values up to 65504: a larger key or value turns infinite there,
            as in llama.cpp's float16 cache.)

    A model built without its quantised weights (:func:`draftwise.backend.weights.gguf_file.file_model`: those
    matrices on the ``meta`` device, every one given by ``quantized``/``embedding``) runs on the CPU.
    """

    backend = "lean"

    def __init__(
        self,
        model: Any,
        linear_min_rows: int = 1,
        attention_min_rows: int = 1,
        packed: bool | None = None,
        kernel: bool | None = None,
        huge_pages: bool = True,
        linear_fixed: bool = False,
        quantization: str | None = None,
        quantized: Mapping[Any, QuantizedMatrix] | MatrixSource | None = None,
        embedding: Any = None,
        activation_bits: int = 16,
        kv_cache_dtype: torch.dtype | str | None = None,
    ) -> None:
        check_activation_bits(activation_bits)
        #: The precision asked for the quantised products' activations (see the class notes).
        self.activation_bits = activation_bits
        reason = unsupported_reason(model)
        if reason is not None:
            raise UnsupportedModelError(f"the lean forward cannot run this model: {reason}")
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.group = self.heads // self.kv_heads
        self.eps = float(config.rms_norm_eps)
        self.intermediate = config.intermediate_size
        self.block = BLOCK
        self.attention_min_rows = attention_min_rows
        #: Whether every linear product runs at exactly ``linear_min_rows`` rows (a fixed step shape).
        self.fixed_row_plan = linear_fixed
        dtype = model.dtype
        self._device = model_device(model)
        device = self._device
        self.packed = packing_available(dtype, device) if packed is None else packed
        self.kernel = self._compiled_kernels(kernel)

        if quantization is not None and quantized:
            raise UnsupportedModelError("give quantization (quantise on load) or quantized (a file's blocks), not both")
        self._check_quantization(quantization or ("file" if quantized else None))
        #: Whether block-quantised products are dequantised (:class:`DequantizedLinear`: CUDA devices, the fixed step
        #: shape, CPUs without the compiled kernels; per call, or once at load on a GPU with room) rather than run by
        #: the compiled CPU kernels.
        self.dequantizing = self.kernel is None or linear_fixed
        if self.dequantizing and isinstance(quantized, MatrixSource):
            raise UnsupportedModelError("products packed for the compiled CPU kernels cannot run here: load the GGUF "
                                        "file itself")
        quantized = quantized or {}
        given = {id(module.weight) for module in quantized}
        if embedding is not None:
            given.add(id(model.get_input_embeddings().weight))
        missing = [name for name, parameter in model.named_parameters()
                   if parameter.device.type == "meta" and id(parameter) not in given]
        if missing:
            raise UnsupportedModelError(f"the model holds no values for {missing[0]} and the forward was given no "
                                        "quantised matrix for it")

        def make_product(weight: torch.Tensor, bias: torch.Tensor | None, modules: tuple[Any, ...]) -> Linear:
            matrix = None
            if quantization is not None:
                matrix = decode(quantize(weight, quantization), quantization)
            elif modules and all(module in quantized for module in modules):
                matrix = (QuantizedMatrix.stack([quantized[module] for module in modules]) if self.dequantizing
                          else packed_product(quantized, modules))
                if matrix.shape != tuple(weight.shape):
                    raise UnsupportedModelError(f"a quantised matrix of shape {matrix.shape} for a product of shape "
                                                f"{tuple(weight.shape)}")
            if matrix is not None:
                if self.dequantizing:
                    # (on a GPU with room, once at load: the per-call dequantisation cost more than the product)
                    return DequantizedLinear(matrix, bias, device, linear_min_rows, linear_fixed,
                                             keep_dequantized=fits_dequantized(matrix.shape, device))
                return QuantizedLinear(matrix, bias, self.kernel, linear_min_rows, activation_bits=activation_bits)
            product = self.linear(weight, bias, linear_min_rows)
            product.fixed_rows = linear_fixed
            return product

        self.layers: list[LeanLayer] = [fuse_layer(layer, make_product) for layer in model.model.layers]
        # (a file's embedding blocks move to a device as rows dequantised there, see EmbeddingRows.to)
        self.embedding = (embedding.to(device) if embedding is not None
                          else model.model.embed_tokens.weight.detach())
        self.norm = model.model.norm.weight.detach()
        head = model.get_output_embeddings()
        self.head = make_product(head.weight.detach(), None if head.bias is None else head.bias.detach(), (head,))
        #: The block quantisations the products' weights are kept in (``"q4_1+q8_0"``: a file's types, lower case,
        #: in the order the forward meets them), ``None`` for float weights.
        types = [kind for product in self.products if isinstance(product, (QuantizedLinear, DequantizedLinear))
                 for kind in product.types]
        self.quantization = quantization_name(dict.fromkeys(types)) or None
        #: Whether the products' weights are in transparent huge pages.
        self.huge_pages = huge_pages and place_in_huge_pages(list(self.products), device)
        inverse = 1.0 / (
            rope_theta(config) ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        )
        angles = torch.outer(torch.arange(self.context_length, dtype=torch.float32, device=device), inverse)
        angles = torch.cat([angles, angles], -1)
        # As transformers does: the table in float32, cast to the model's dtype. rotate_half(x) * sin equals
        # roll(x, half) * sin with the first half of sin negated: one roll instead of two slices, a negation and a cat.
        self.cos = angles.cos().to(dtype)
        sin = angles.sin()
        half = self.head_dim // 2
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], -1).to(dtype)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self._cache_dtype = self._cache_dtype_for(kv_cache_dtype)
        self.compiled_layers = self._compiled_layers()

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the caches keep keys and values in (see ``kv_cache_dtype``)."""
        return self._cache_dtype

    def _cache_dtype_for(self, asked: torch.dtype | str | None) -> torch.dtype:
        """The caches' dtype for ``kv_cache_dtype`` (see the class notes); a clear error where it cannot run."""
        dtype = self.dtype
        half_beside_float32 = dtype == torch.float32 and self.kernel is not None
        try:
            named = named_kv_cache_dtype(asked)
        except ValueError as error:
            raise UnsupportedModelError(str(error)) from None
        if named is None:
            quantized = any(isinstance(product, QuantizedLinear) for product in self.products)
            return torch.float16 if half_beside_float32 and quantized else dtype
        if named == dtype or (named == torch.float16 and half_beside_float32):
            return named
        raise UnsupportedModelError(
            f"a {str(named).removeprefix('torch.')} cache cannot run beside {str(dtype).removeprefix('torch.')} "
            "activations here: keep the model's dtype (float16 runs beside float32 on the compiled CPU kernels)")

    def _check_quantization(self, quantization: str | None) -> None:
        """A clear error where this forward cannot keep its products' weights in ``quantization`` (they need
        float32 rows and input widths in whole groups of 32)."""
        if quantization is None:
            return
        if quantization != "file" and quantization not in QUANTIZATIONS:
            raise UnsupportedModelError(f"unknown weights {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
        if self.model.dtype != torch.float32:
            raise UnsupportedModelError(f"{quantization} weights run with float32 activations: load the model in "
                                        f"float32, not {self.model.dtype}")
        odd = sorted({layer.weight.shape[1] for layer in self.model.modules()
                      if isinstance(layer, torch.nn.Linear) and layer.weight.shape[1] % BLOCK_INPUTS})
        if odd:
            raise UnsupportedModelError(f"{quantization} weights need input widths that are multiples of "
                                        f"{BLOCK_INPUTS}; this model has {odd}")

    def _compiled_kernels(self, wanted: bool | None) -> Any | None:
        """The compiled kernels' module, if used (see the ``kernel`` argument)."""
        if wanted is False:
            return None
        reason = None
        if self.device.type != "cpu":
            reason = f"it runs on CPUs, not {self.device.type}"
        elif self.group > 8:
            reason = f"{self.group} query heads per key/value head (at most 8)"
        else:
            from .. import native

            module = native.load_kernels(warn=wanted is None)
            if module is not None:
                return module
            reason = native.unavailable_reason()
        if wanted:
            raise UnsupportedModelError(f"the compiled kernels cannot run here: {reason}")
        return None

    @property
    def kernels_build(self) -> str | None:
        """The compiled kernels' build key (:func:`draftwise.backend.native.build_key`), ``None`` on the library
        path."""
        if self.kernel is None:
            return None
        from .. import native

        return native.build_key()

    @property
    def attention_path(self) -> str:
        """``"kernel"`` (the compiled kernels) or ``"library"`` (torch operations) for attention's decode rows and
        the row-wise steps."""
        return "kernel" if self.kernel is not None else "library"

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int | None = None) -> Linear:
        """A product by ``weight`` (and ``bias``) the way this forward runs its own: the compiled blocked kernel
        where it can (float32 and bfloat16 with AVX2 and FMA or AVX-512), oneDNN's packed weights or ``F.linear``
        otherwise."""
        return Linear(weight.detach(), None if bias is None else bias.detach(), self.packed,
                      self.linear_min_rows if min_rows is None else min_rows, kernels=self.kernel)

    @property
    def kernel_activation_bits(self) -> int | None:
        """The precision the products' activations are quantised to: :attr:`activation_bits` where block-quantised
        products run on the compiled kernels, ``None`` where none do (float weights, or dequantised per call)."""
        return self.activation_bits if self.quantization is not None and not self.dequantizing else None

    @property
    def linear_path(self) -> str:
        """``"kernel"`` (the compiled blocked products), ``"kernel-q8_0"``, ``"kernel-q4_1+q8_0"``... (the compiled
        products over block-quantised weights, see :attr:`quantization`), ``"onednn"`` (packed weights) or
        ``"library"`` (``F.linear``) for the linear products."""
        if self.quantization is not None:
            return f"{'dequantized' if self.dequantizing else 'kernel'}-{self.quantization}"
        return "kernel" if self.head.blocked is not None else "onednn" if self.head.packed else "library"

    def _compiled_layers(self) -> Any | None:
        """The decoder layers as one compiled loop (:class:`draftwise.backend.native` ``DecoderLayers``) where every
        product runs through the blocked or the quantised kernel: the same kernels in the same order as :meth:`_run`'s
        loop, bitwise its results, without the interpreter's per-operation cost (0.3-0.4 ms of a 30-layer forward)."""
        if self.kernel is None or self.fixed_row_plan:
            return None
        products = [linear for layer in self.layers for linear in layer.products]
        if not all(linear.blocked is not None or isinstance(linear, QuantizedLinear) for linear in products):
            return None
        return self.kernel.DecoderLayers(
            [norm for layer in self.layers for norm in (layer.attention_norm, layer.mlp_norm)],
            [linear.weight for linear in products],
            [linear.bias for linear in products],
            [linear.format if isinstance(linear, QuantizedLinear) else -1 for linear in products],
            [linear.out_features for linear in self.layers[0].products], self.heads, self.kv_heads, self.eps,
            self.scale, self.activation_bits,
        )

    @property
    def linear_min_rows(self) -> int:
        return self.head.min_rows

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def products(self) -> Iterator[Linear]:
        """Every linear product, in the order a forward runs them."""
        return all_products(self.layers, self.head)

    def set_row_plan(self, linear_min_rows: int, attention_min_rows: int) -> None:
        """Pad products to these row counts (measured by :mod:`draftwise.backend.calibration.invariance`)."""
        if self.fixed_row_plan:
            raise ValueError("this target runs every product at a fixed row count: it has no row plan to set")
        for linear in self.products:
            linear.min_rows = linear_min_rows
        self.attention_min_rows = attention_min_rows

    @property
    def batch_chains(self) -> bool:  # type: ignore[override]
        # The library path reads a chain's blocks in place, while a tree's rows each need their own gathered copies.
        # The kernel reads every row's keys in place, trees' included.
        return self.kernel is None

    @property
    def chunked_prefill(self) -> bool:  # type: ignore[override]
        # With the kernels a prompt's rows are verification rows (see prefill); the library path's causal attention
        # over a whole prompt rounds otherwise.
        return self.kernel is not None

    # ----------------------------------------------------------------------------------------------- cache

    def new_cache(self, capacity: int) -> LeanCache:
        return LeanCache(
            len(self.layers), self.kv_heads, self.head_dim, self.block, capacity + self.block, self.kv_dtype,
            self.device,
        )

    def cache_length(self, cache: LeanCache) -> int:
        return cache.length

    def truncate(self, cache: LeanCache, length: int) -> None:
        if not 0 <= length <= cache.length:
            raise ValueError(f"cannot truncate to {length}: {cache.length} positions are committed")
        cache.length = length

    @property
    def prefix_caching(self) -> bool:  # type: ignore[override]
        return self.chunked_prefill and self.exact_trees

    def read_positions(self, cache: LeanCache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= start < end <= cache.length:
            raise ValueError(f"positions {start}..{end - 1} are not all committed ({cache.length} positions)")
        return cache.read(start, end)

    def write_positions(self, cache: LeanCache, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if start != cache.length:
            raise ValueError(f"positions are written after the committed ones ({cache.length}), not at {start}")
        cache.write(start, keys, values)
        cache.length = start + keys.shape[2]

    def commit(self, cache: LeanCache, rows: Sequence[int]) -> None:
        rows = list(rows)
        start = cache.length
        if rows != list(range(len(rows))):
            cache.move(torch.tensor([start + row for row in rows], device=self.device), start)
        cache.length = start + len(rows)

    def skipped_logits(self, cache: LeanCache, tokens: Sequence[int], start: int, skip: LayerSkip) -> torch.Tensor:
        """The logits after each of ``tokens`` (committed at positions ``start ..``) of the model with ``skip`` left
        out, on the committed keys and values before ``start``: how well a skip set would have drafted text the model
        already wrote, in one forward (SWIFT's parallel matchness check).

        The rows are computed in the slots they occupy; those slots are saved before and put back after, so the
        cache (keys, values and length) is left bitwise as it was.
        """
        committed, end = cache.length, start + len(tokens)
        if not tokens or start < 0 or end > committed:
            raise ValueError(f"rows {start}..{end - 1} are not all committed ({committed} positions)")
        region = cache.region(start, end)
        saved = cache.keys[region].clone(), cache.values[region].clone()
        cache.length = start
        try:
            return self.forward([cache], [RowBlock.chain(list(tokens))], skip=skip).logits[0]
        finally:
            cache.keys[region] = saved[0]
            cache.values[region] = saved[1]
            cache.length = committed

    # --------------------------------------------------------------------------------------------- forward

    def _mlp(self, layer: LeanLayer, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        gate_up = layer.gate_up(self._rms_norm(hidden, layer.mlp_norm, self.linear_min_rows))
        if self.kernel is not None:
            # gate_up has the products' padded row count already, and so does silu_mul's output.
            output = layer.down(self.kernel.silu_mul(gate_up, rows, self.linear_min_rows))
            return output[:rows] if output.shape[0] > rows else output
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return layer.down(torch.nn.functional.silu(gate) * up)

    def _rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        """RMSNorm of every row; on the kernel path with at least ``min_rows`` rows (zeros past ``hidden``'s), so
        that a product fed by it needs no padding of its own (the library path's products pad themselves)."""
        if self.kernel is not None:
            return self.kernel.rms_norm(hidden, weight, self.eps, min_rows)
        # transformers' order: in float32, scaled, cast back, then weighted.
        hidden32 = hidden.float()
        hidden32 = hidden32 * torch.rsqrt(hidden32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * hidden32.to(hidden.dtype)

    def _rotate(self, states: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        return states * cos + torch.roll(states, self.head_dim // 2, -1) * signed_sin

    def _run(
        self, caches: Sequence[LeanCache], tokens: Sequence[Sequence[int]], depths: Sequence[Sequence[int]], attend,
        skip: LayerSkip | None = None, deferred: frozenset[int] = frozenset(), layout: RaggedLayout | None = None,
    ) -> list[torch.Tensor]:
        """The decoder layers over each sequence's new rows (``tokens[i]`` at its cache length plus ``depths[i]``),
        all sequences' rows in the same products, each sequence's attention on its own cache; the rows' keys and
        values are written into the caches after their lengths first (except those of ``deferred`` sequences).
        ``attend(layer, queries, keys, values)`` does every sequence's attention (given all new rows' queries, keys
        and values, one sequence after the other) and returns its rows' outputs in the same order. ``skip`` names
        sub-layers left out (a layer-skipping draft: a skipped attention writes no keys or values). The sequences
        ``deferred`` (by index; their attention takes this forward's rows from the keys and values it is given) get
        every layer's keys and values written once, after the last layer: a write per sequence per forward instead
        of per layer. With ``layout`` (every sequence's rows as the compiled attention reads them; every sequence
        ``deferred``, no ``skip``), the layers run as one compiled loop where this target has it. Returns each
        sequence's final normed hidden states."""
        if deferred and skip is not None:
            raise ValueError("a layer-skipping forward writes its keys and values layer by layer")
        sizes = [len(row_tokens) for row_tokens in tokens]
        device = self.device
        flat_tokens = torch.tensor([token for row_tokens in tokens for token in row_tokens], device=device)
        positions = torch.tensor(
            [cache.length + depth for cache, row_depths in zip(caches, depths) for depth in row_depths], device=device
        )
        slots = []
        for sequence, (cache, size) in enumerate(zip(caches, sizes)):
            cache.reserve(cache.length + size)
            if sequence in deferred:
                slots.append(None)
            else:
                where = torch.arange(cache.length, cache.length + size, device=device)
                slots.append((where // self.block, where % self.block))
        bounds = [sum(sizes[:index]) for index in range(len(sizes) + 1)]
        cos = self.cos[positions]
        sin = self.signed_sin[positions]
        hidden = self.embedding[flat_tokens]
        skip_attention = skip.attention if skip is not None else frozenset()
        skip_mlp = skip.mlp if skip is not None else frozenset()
        if layout is not None and skip is None and self.compiled_layers is not None:
            hidden, all_keys, all_values = self.compiled_layers.run(
                hidden, cos, sin, self.linear_min_rows, [cache.keys for cache in caches],
                [cache.values for cache in caches], layout.row_sequence, layout.row_committed, layout.path_offsets,
                layout.path_rows,
            )
        else:
            # Every layer's keys and values, kept until the deferred sequences' caches are written.
            written: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if deferred else None
            for index, layer in enumerate(self.layers):
                if index not in skip_attention:
                    hidden = self._attention_block(index, layer, hidden, caches, slots, bounds, cos, sin, attend,
                                                   written)
                if index not in skip_mlp:
                    hidden = hidden + self._mlp(layer, hidden)
            if written:
                all_keys = torch.stack([keys for keys, _ in written])  # (layers, rows, kv_heads, head_dim)
                all_values = torch.stack([values for _, values in written])
        if deferred:
            for sequence in sorted(deferred):
                self._write_rows(caches[sequence], all_keys, all_values, bounds[sequence], sizes[sequence])
        states = self._rms_norm(hidden, self.norm)
        return [states[bounds[sequence] : bounds[sequence + 1]] for sequence in range(len(sizes))]

    def _write_rows(self, cache: LeanCache, keys: torch.Tensor, values: torch.Tensor, first: int, size: int) -> None:
        """Every layer's keys and values of one sequence's rows (``first .. first + size`` of ``(layers, rows,
        kv_heads, head_dim)``) into its cache after its length: one copy per block they fall in (one kernel call for
        all of them, with the compiled kernels)."""
        if self.kernel is not None:
            self.kernel.write_rows(cache.keys, cache.values, keys, values, cache.length, first, size)
            return
        slot, row = cache.length, first
        while row < first + size:
            offset = slot % self.block
            count = min(self.block - offset, first + size - row)
            cache.keys[:, slot // self.block, :, offset : offset + count] = keys[:, row : row + count].transpose(1, 2)
            cache.values[:, slot // self.block, :, offset : offset + count] = values[:, row : row + count].transpose(1, 2)
            slot, row = slot + count, row + count

    def _attention_block(self, index, layer, hidden, caches, slots, bounds, cos, sin, attend, written) -> torch.Tensor:
        """One layer's attention sub-layer with its residual; writes the rows' keys and values into the caches of
        sequences with slots, and appends them to ``written`` (when given) for the others."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        rows = hidden.shape[0]
        qkv = layer.qkv(self._rms_norm(hidden, layer.attention_norm, self.linear_min_rows))
        if self.kernel is not None:
            queries, keys = self.kernel.rotate_queries_keys(qkv, cos, sin, rows, heads, kv_heads, self.scale)
        else:
            query_key = self._rotate(
                qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim), cos[:, None], sin[:, None]
            )
            queries = query_key[:, :heads] * self.scale
            keys = query_key[:, heads:]
        values = qkv[:rows, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        if keys.dtype != self.kv_dtype:  # (rounded as the caches keep them, see kv_cache_dtype)
            keys, values = keys.to(self.kv_dtype), values.to(self.kv_dtype)
        for sequence, (cache, slot) in enumerate(zip(caches, slots)):
            if slot is None:
                continue
            part = slice(bounds[sequence], bounds[sequence + 1])
            cache.keys[index, slot[0], :, slot[1]] = keys[part]
            cache.values[index, slot[0], :, slot[1]] = values[part]
        if written is not None:
            written.append((keys, values))
        return hidden + layer.output(attend(index, queries, keys, values))

    def _outputs(
        self, states: Sequence[torch.Tensor], hidden_states: bool, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> ForwardOutput:
        """Logits of every sequence's rows from one product over all of them (by ``head`` when given)."""
        logits = (self.head if head is None else head)(states[0] if len(states) == 1 else torch.cat(states))
        bounds = [0]
        for part in states:
            bounds.append(bounds[-1] + part.shape[0])
        return ForwardOutput(
            [logits[bounds[index] : bounds[index + 1]] for index in range(len(states))],
            list(states) if hidden_states else None,
        )

    def _attention_group(
        self, caches: Sequence[LeanCache], blocks: Sequence[RowBlock], starts: Sequence[int], members: Sequence[int],
        defer: bool = True,
    ) -> tuple[torch.Tensor, Callable[..., torch.Tensor], bool]:
        """The flat rows of the sequences ``members`` (chains, or trees, of one row-count bucket; ``starts``: every
        sequence's first flat row), the function computing their attention at a layer from their queries, keys and
        values as one set of products, and whether it takes their keys and values from its arguments (their caches
        are then written once per forward, see :meth:`_run`; only with ``defer``)."""
        rows = torch.tensor([starts[index] + row for index in members for row in range(len(blocks[index]))],
                            device=self.device)
        sizes = [len(blocks[index]) for index in members]
        if is_chain(blocks[members[0]].parents):
            layout = rows_layout([caches[index].length for index in members], sizes, self.block, self.kv_heads,
                                 self.group, self.attention_min_rows, self.device)
            given = defer and len(members) > 1  # (one sequence's blocks are read in place, from its cache)

            def compute(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
                return rows_attention(queries, [caches[index].keys[layer] for index in members],
                                      [caches[index].values[layer] for index in members], layout,
                                      keys if given else None, values if given else None)

            return rows, compute, given
        together = batch_layout(
            [tail_layout(caches[index].length, blocks[index].parents, self.block, self.kv_heads, self.device)
             for index in members],
            sizes, self.block, self.kv_heads,
        )
        buffers = None
        if together.shared_blocks:
            size = (len(members), together.shared_blocks, self.kv_heads, self.block, self.head_dim)
            buffers = (torch.zeros(size, dtype=self.kv_dtype, device=self.device),
                       torch.zeros(size, dtype=self.kv_dtype, device=self.device))

        def compute(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            return batch_block_attention(queries, [caches[index].keys[layer] for index in members],
                                         [caches[index].values[layer] for index in members], together, buffers,
                                         self.attention_min_rows)

        return rows, compute, False

    def prefill(
        self, caches: Sequence[LeanCache], prompts: Sequence[Sequence[int]], hidden_states: bool = False,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """See :meth:`Target.prefill`; ``head`` replaces the output head as in :meth:`forward`."""
        if any(cache.length for cache in caches):
            raise ValueError("prefill needs empty caches")

        if self.kernel is not None:
            # The prompt's rows are verification rows (a chain on the cache), in pieces of at most PREFILL_PIECE
            # rows: every row is bitwise what one-row decoding of the prompt computes, so a scheduler may prefill
            # the same prompt in smaller pieces beside other sequences' rows and get the same bits
            # (``chunked_prefill``). Measured as fast as the former runs of 32 prompt rows (SmolLM2-135M, float32 and
            # bfloat16, 64 to 512 rows, a two-core Zen 3).
            outputs = []
            for cache, prompt in zip(caches, prompts):
                for first in range(0, len(prompt), PREFILL_PIECE):
                    piece = list(prompt[first : first + PREFILL_PIECE])
                    output = self.forward([cache], [RowBlock.chain(piece)], last_only=True,
                                          hidden_states=hidden_states, head=head)
                    cache.length += len(piece)
                outputs.append(output)
            return ForwardOutput([output.logits[0] for output in outputs],
                                 [output.hidden_states[0] for output in outputs] if hidden_states else None)
        # One prompt at a time: a prefill's rows are exactly those of the same prompt decoded alone (products of
        # thousands of rows are not assumed to keep every row's bits), whatever else is decoded beside it.
        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            return causal_attention(queries, keys, values)

        states = []
        for cache, prompt in zip(caches, prompts):
            states.append(self._run([cache], [prompt], [range(len(prompt))], attend)[0][-1:])
            cache.length = len(prompt)
        return self._outputs(states, hidden_states, head)

    def forward(
        self,
        caches: Sequence[LeanCache],
        blocks: Sequence[RowBlock],
        *,
        last_only: bool | Sequence[bool] = False,
        hidden_states: bool = False,
        skip: LayerSkip | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """See :meth:`Target.forward`; ``skip`` runs the model with those sub-layers left out (a draft of itself:
        its rows are never committed, see :mod:`draftwise.drafters.layer_skip`); ``head`` maps the final hidden
        states to logits instead of the model's output head (a draft head over part of the vocabulary, see
        :class:`draftwise.drafters.draft_model.DraftHead`)."""
        groups = row_groups([len(block.tokens) for block in blocks], MAX_FORWARD_ROWS)
        if len(groups) > 1:
            last = last_rows_only(last_only, len(blocks))
            outputs = [
                self.forward([caches[index] for index in group], [blocks[index] for index in group],
                             last_only=[last[index] for index in group], hidden_states=hidden_states, skip=skip,
                             head=head)
                for group in groups
            ]
            return ForwardOutput(
                [logits for output in outputs for logits in output.logits],
                [states for output in outputs for states in output.hidden_states] if hidden_states else None,
            )
        build = {"kernel": self._kernel_attention, "one-row": self._one_row_attention,
                 "tree": self._tree_attention, "grouped": self._grouped_attention}[self.forward_path(caches, blocks)]
        # (A layer-skipping draft writes its keys and values layer by layer: its skipped layers write none.)
        attention = build(caches, blocks, defer=skip is None)
        states = self._run(caches, [block.tokens for block in blocks], [block.depths for block in blocks],
                           attention.attend, skip, attention.deferred, attention.layout)
        states = [part[-1:] if last else part
                  for part, last in zip(states, last_rows_only(last_only, len(blocks)))]
        return self._outputs(states, hidden_states, head)

    # ------------------------------------------------------------------------------------- forward paths

    def forward_path(self, caches: Sequence[LeanCache], blocks: Sequence[RowBlock]) -> str:
        """Which attention path :meth:`forward` takes for these rows (see :data:`FORWARD_PATHS`)."""
        if self.kernel is not None:
            return "kernel"
        if len(caches) == 1 and len(blocks[0].tokens) == 1:
            return "one-row"
        if len(caches) == 1 and not is_chain(blocks[0].parents):
            return "tree"
        return "grouped"

    def _kernel_attention(self, caches: Sequence[LeanCache], blocks: Sequence[RowBlock], defer: bool) -> Attention:
        """Every row in one compiled call per layer, its committed keys read in place and this forward's from the
        new rows; the caches are written once, after the last layer (layer by layer for a layer-skipping draft,
        whose skipped layers write nothing)."""
        layout = ragged_layout([cache.length for cache in caches], [block.parents for block in blocks])
        kernel = self.kernel

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            return kernel.ragged_attention(queries, keys, values, [cache.keys for cache in caches],
                                           [cache.values for cache in caches], index, layout.row_sequence,
                                           layout.row_committed, layout.path_offsets, layout.path_rows)

        return Attention(attend, frozenset(range(len(caches))) if defer else frozenset(), layout)

    def _one_row_attention(self, caches: Sequence[LeanCache], blocks: Sequence[RowBlock], defer: bool) -> Attention:
        """Plain one-row decoding on the library path."""
        cache, shape = caches[0], (self.kv_heads, self.group, self.head_dim)

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            return single_row_attention(queries.view(-1, *shape), cache.keys[index], cache.values[index],
                                        cache.length, self.attention_min_rows)

        return Attention(attend)

    def _tree_attention(self, caches: Sequence[LeanCache], blocks: Sequence[RowBlock], defer: bool) -> Attention:
        """One sequence's tree on the library path: each row over the blocks its path reaches."""
        cache, shape = caches[0], (self.kv_heads, self.group, self.head_dim)
        layout = tail_layout(cache.length, blocks[0].parents, self.block, self.kv_heads, self.device)

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            return block_attention(queries.view(-1, *shape), cache.keys[index], cache.values[index], layout,
                                   self.attention_min_rows)

        return Attention(attend)

    def _grouped_attention(self, caches: Sequence[LeanCache], blocks: Sequence[RowBlock], defer: bool) -> Attention:
        """Several sequences (or one chain) on the library path: one set of products per group of sequences (lone
        rows, longer chains, trees by row count; see :func:`_bucket_members`), chains (every block in place) apart
        from trees, each row bitwise its own result."""
        shape = (self.kv_heads, self.group, self.head_dim)
        starts = list(itertools.accumulate((len(block.tokens) for block in blocks), initial=0))
        bucketed = _bucket_members([len(block.tokens) for block in blocks],
                                   [is_chain(block.parents) for block in blocks])
        # A layer-skipping draft writes its keys and values layer by layer (its skipped layers write none).
        groups = [self._attention_group(caches, blocks, starts, members, defer=defer) for members in bucketed]
        deferred = frozenset(index for members, (_, _, given) in zip(bucketed, groups) if given for index in members)

        def attend(index: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            queries = queries.view(-1, *shape)
            if len(groups) == 1:
                return groups[0][1](index, queries, keys, values)
            output = queries.new_empty(queries.shape[0], self.heads * self.head_dim)
            for rows, compute, given in groups:
                group_keys = keys.index_select(0, rows) if given else keys
                group_values = values.index_select(0, rows) if given else values
                output.index_copy_(0, rows, compute(index, queries.index_select(0, rows), group_keys, group_values))
            return output

        return Attention(attend, deferred)
