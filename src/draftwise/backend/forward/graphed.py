"""The lean forward in one fixed shape, replayed as a CUDA graph: the engine's forward on GPUs.

A small model's step on a GPU is bound by its launches, not by the device: the library path runs some 600 kernels
a token, each launched by the interpreter, and a fast GPU waits on a slow host most of the time. Here every step of
a sequence has the same shape, so that one captured graph replays it with one launch:

- **rows**: every product runs at exactly :attr:`~GraphedLeanTarget.step_rows` rows (:data:`STEP_ROWS` in 16-bit
  dtypes, :data:`FLOAT32_STEP_ROWS` in float32; a block of more rows runs as several steps, a block of fewer is
  padded): GPU libraries choose their kernel by the row count at every size, so one shape is the one way a row's
  bits cannot depend on how many rows share its step;
- **attention in two fixed parts**: a sequence's keys and values live in one ``(layers, kv_heads, positions,
  head_dim)`` buffer as long as the model's context. Each row's *window* starts at a block boundary set by its own
  position alone, at least :data:`TREE_DEPTH` positions back; everything before it is committed, and one product over
  the whole buffer (masked from the window on) gives every row that part. The window's keys and values are gathered
  per row along the row's own path, so its ancestors sit at their positions exactly as plain decoding's committed
  tokens do. Both parts share one maximum and one normaliser, and every shape is the same at every step: a row's
  arithmetic depends on its position and its path's tokens, never on where its ancestors were written or on the
  other rows.

So every row of a verification step is bitwise what plain one-row decoding computes at its position, in every
dtype, with no row plan to measure: :func:`draftwise.backend.calibration.invariance.plan_rows` still checks it on the running
machine. Each cache owns a captured graph (captured at its first step; caches are pooled, so a finished sequence's
buffers and graph serve the next one). The same step runs eagerly, bitwise alike, where no graph can run: on CPUs
(tests), and for layer-skipping drafts; or through ``torch.compile`` (``compiled=True``), graphed or not.
Batches run one graph replay per sequence.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..rows import CACHE, RowBlock, is_chain
from ..target import ForwardOutput, last_rows_only
from .lean import BLOCK, LayerSkip, LeanTarget, model_device

#: Rows of every step in a 16-bit dtype: on a GPU's tensor cores a product of 64 rows costs about what one row does.
STEP_ROWS = 64
#: Rows of every step in float32, whose products run on the GPU's plain cores: there 64 rows cost several times one
#: row, while 16 rows cost little more than reading the weights once.
FLOAT32_STEP_ROWS = 16
#: Most rows of one sequence's draft tree in a forward (a chain of any length runs as consecutive steps).
TREE_ROWS = 256
#: Most depth of a draft tree's rows below the committed cache.
TREE_DEPTH = 64
#: Positions of each row's window (see :meth:`GraphedLeanTarget._layers`): from a block boundary at least
#: ``TREE_DEPTH - 1`` positions before the row to the row itself.
WINDOW = TREE_DEPTH - 1 + BLOCK


class _Slot:
    """One sequence's device state: its keys and values, the step's inputs, and the graph captured over them."""

    @torch.inference_mode(False)  # (updated in place by steps run in and out of inference mode alike)
    def __init__(self, layers: int, kv_heads: int, positions: int, head_dim: int, rows: int, dtype, device) -> None:
        shape = (layers, kv_heads, positions, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # tokens, positions and cache slots of the step's rows, then the committed length the rows follow.
        self.inputs = torch.zeros(3 * rows + 1, dtype=torch.long, device=device)
        self.inputs[2 * rows : 3 * rows] = positions - 1  # padding rows write the scratch position
        #: ``path[i, k]``: the block row (written at committed length + it) of row ``i``'s ancestor at depth ``k``.
        self.path = torch.zeros(rows, TREE_DEPTH, dtype=torch.long, device=device)
        self.graph: Any = None
        self.states: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None


class SpanCache:
    """The keys and values of one sequence for :class:`GraphedLeanTarget`: positions ``0 .. length - 1`` are
    committed; a forward writes its rows after them, and :meth:`GraphedLeanTarget.commit` moves the accepted ones
    into place."""

    def __init__(self, slot: _Slot) -> None:
        self.slot = slot
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        return self.slot.keys

    @property
    def values(self) -> torch.Tensor:
        return self.slot.values

    def region(self, start: int, end: int) -> tuple[slice, slice, slice]:
        """An index of ``keys`` and ``values`` covering positions ``start .. end - 1`` of every layer."""
        return slice(None), slice(None), slice(start, end)

    def move(self, sources: torch.Tensor, start: int) -> None:
        """Copy the positions ``sources`` of every layer to ``start, start + 1, ...`` (sources read first)."""
        targets = torch.arange(start, start + sources.shape[0], device=sources.device)
        for buffer in (self.keys, self.values):
            buffer[:, :, targets] = buffer[:, :, sources]


class GraphedLeanTarget(LeanTarget):
    """A llama- or qwen2-family model on the lean forward in one fixed step shape (see the module docstring).

    Args:
        model: the transformers model whose weights are used.
        span: most positions a sequence may reach (default: the model's context length); every row's attention
            runs over this many, so a smaller span is cheaper, and a longer sequence is an error.
        graphs: replay steps as CUDA graphs (default: on CUDA devices).
        compiled: run the step through ``torch.compile`` (default off). The step has one shape, so it compiles
            once per model shape, dtype, span and step width (at a target's first step: a minute or more on a GPU,
            less when PyTorch's compile cache holds it; targets of one shape share the compiled code, their weights being its inputs), and its
            kernels fuse the dozens of small operations each layer launches (a graphed GPU step
            is bound by their count, not by the weights it reads). Every step of every sequence runs the same
            compiled step, so its rows stay bitwise plain decoding's (with the compiled step's own rounding, not
            the eager step's). On an H200 a SmolLM2-135M-shaped step 9.5 -> 6.8 ms, a Qwen2.5-1.5B-shaped one
            25.1 -> 23.8 ms, after 80-100 s of compiling: off by default (``load_model(torch_compile=True)``).
        step_rows: rows of every step, at most :data:`TREE_DEPTH` (default :data:`STEP_ROWS` in 16-bit dtypes,
            :data:`FLOAT32_STEP_ROWS` in float32). A longer block runs as several steps; a sequence's bits depend on
            this number.
        options: :class:`LeanTarget`'s ``packed``, and its ``quantization``, ``quantized`` and ``embedding`` for
            block-quantised products, dequantised at each step on the device
            (:class:`~draftwise.backend.weights.quantized.DequantizedLinear`).
    """

    def __init__(self, model: Any, span: int | None = None, graphs: bool | None = None, step_rows: int | None = None,
                 compiled: bool = False, **options: Any) -> None:
        if step_rows is None:
            step_rows = FLOAT32_STEP_ROWS if model.dtype == torch.float32 else STEP_ROWS
        if not 1 <= step_rows <= TREE_DEPTH:  # (a chain step's rows find their ancestors within TREE_DEPTH)
            raise ValueError(f"step_rows must be 1..{TREE_DEPTH}, not {step_rows}")
        #: Rows of every step (every product runs at exactly this many).
        self.step_rows = int(step_rows)
        on_cuda = model_device(model).type == "cuda"
        self.graphs = on_cuda if graphs is None else graphs
        if self.graphs and not on_cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        #: Whether steps run through ``torch.compile`` (layer-skipping drafts' steps run eagerly either way).
        self.compiled = bool(compiled)
        if self.compiled:
            if options.get("packed"):
                raise ValueError("a compiled step takes unpacked weights (oneDNN's packed ones have no compiled form)")
            options["packed"] = False
        # Every product runs at a fixed row count: there is no padding to measure (see ``plan_rows``).
        super().__init__(model, self.step_rows, self.step_rows, kernel=False, linear_fixed=True, **options)
        # (fullgraph: a graph break or a recompile past dynamo's limit is an error, never a silent eager step, whose
        # rounding would differ)
        self._step_function = (torch.compile(self._full_step, dynamic=False, fullgraph=True) if self.compiled
                               else self._full_step)
        self._set_span(self.context_length if span is None else int(span))
        self._chain_path = torch.arange(TREE_DEPTH, device=self.device).expand(self.step_rows, TREE_DEPTH).contiguous()
        self._window_offsets = torch.arange(WINDOW, device=self.device)
        with torch.inference_mode(False):  # (written at every step, in and out of inference mode)
            self._staging = torch.zeros(3 * self.step_rows + 1, dtype=torch.long,
                                        pin_memory=self.device.type == "cuda")
        self._pool: Any = None

    @property
    def attention_path(self) -> str:
        return "graph" if self.graphs else "static"

    def _set_span(self, span: int) -> None:
        if not 0 < span <= self.context_length:
            raise ValueError(f"span must be 1..{self.context_length} (the model's context), not {span}")
        #: Most positions a sequence may reach: every row's attention runs over this many.
        self.span = span
        # Room for a tree after the last committed position, and a last position that padding rows write.
        self.positions = -(-(self.span + TREE_ROWS + 1) // self.step_rows) * self.step_rows
        self._columns = torch.arange(self.positions, device=self.device)
        self._free: list[_Slot] = []  # (slots of another span cannot serve)

    def limit_context(self, length: int) -> None:
        """See :meth:`Target.limit_context`: every step's attention then covers ``length`` positions (plus room for a
        tree), not the model's whole context."""
        super().limit_context(length)
        self._set_span(min(self.span, self.context_length))

    # ----------------------------------------------------------------------------------------------- cache

    def new_cache(self, capacity: int) -> SpanCache:
        slot = self._free.pop() if self._free else _Slot(
            len(self.layers), self.kv_heads, self.positions, self.head_dim, self.step_rows, self.kv_dtype, self.device)
        cache = SpanCache(slot)
        weakref.finalize(cache, self._free.append, slot)  # a finished sequence's slot (and graph) serves the next
        return cache

    # --------------------------------------------------------------------------------------------- forward

    def prefill(
        self, caches: Sequence[SpanCache], prompts: Sequence[Sequence[int]], hidden_states: bool = False,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ForwardOutput:
        if any(cache.length for cache in caches):
            raise ValueError("prefill needs empty caches")
        output = self.forward(caches, [RowBlock.chain(list(prompt)) for prompt in prompts], last_only=True,
                              hidden_states=hidden_states, head=head)
        for cache, prompt in zip(caches, prompts):
            cache.length = len(prompt)
        return output

    def forward(
        self,
        caches: Sequence[SpanCache],
        blocks: Sequence[RowBlock],
        *,
        last_only: bool | Sequence[bool] = False,
        hidden_states: bool = False,
        skip: LayerSkip | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """See :meth:`LeanTarget.forward`. Each sequence runs on its own, in steps of :attr:`step_rows` rows."""
        logits, states = [], []
        for cache, block, last in zip(caches, blocks, last_rows_only(last_only, len(blocks))):
            sequence_logits, sequence_states = self._sequence(cache, block, last, skip, head)
            logits.append(sequence_logits)
            states.append(sequence_states)
        return ForwardOutput(logits, states if hidden_states else None)

    def _sequence(
        self, cache: SpanCache, block: RowBlock, last_only: bool, skip: LayerSkip | None,
        head: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's rows, step by step: a chain's later steps take its earlier rows as committed, a tree's
        steps see their ancestors among all the block's rows."""
        rows, committed = len(block.tokens), cache.length
        if rows == 0:
            raise ValueError("a forward needs at least one row per sequence")
        depths = block.depths
        if committed + max(depths) >= self.span:
            raise ValueError(f"rows up to position {committed + max(depths)} are past the span of {self.span} positions")
        chain = is_chain(block.parents)
        paths = None
        if not chain:
            if rows > TREE_ROWS or max(depths) >= TREE_DEPTH:
                raise ValueError(f"a draft tree of {rows} rows and depth {max(depths) + 1} is more than one forward "
                                 f"verifies ({TREE_ROWS} rows, depth {TREE_DEPTH})")
            paths = _tree_paths(block.parents, depths)
        logits, states = [], []
        slot, step = cache.slot, self.step_rows
        for first in range(0, rows, step):
            count = min(step, rows - first)
            # A chain's earlier steps are committed for its later ones: each step is a chain of its own.
            base = committed + first if chain else committed
            staging = self._staging
            staging.zero_()
            staging[:count] = torch.tensor(block.tokens[first : first + count])
            staging[step : step + count] = torch.tensor(
                [committed + depth for depth in depths[first : first + count]])
            staging[2 * step : 3 * step] = self.positions - 1  # padding rows write the scratch position
            staging[2 * step : 2 * step + count] = torch.arange(committed + first, committed + first + count)
            staging[3 * step] = base
            slot.inputs.copy_(staging)
            if chain:
                slot.path.copy_(self._chain_path)
            else:
                step_paths = torch.zeros(step, TREE_DEPTH, dtype=torch.long)
                step_paths[:count] = paths[first : first + count]
                slot.path.copy_(step_paths)
            step_states, step_logits = self._step(slot, skip, want_logits=head is None)
            if last_only:
                if first + count == rows:
                    states.append(step_states[count - 1 : count].clone())
                    logits.append(None if head is not None else step_logits[count - 1 : count].clone())
                continue
            states.append(step_states[:count].clone())
            logits.append(None if head is not None else step_logits[:count].clone())
        all_states = states[0] if len(states) == 1 else torch.cat(states)
        if head is not None:
            return head(all_states), all_states
        return (logits[0] if len(logits) == 1 else torch.cat(logits)), all_states

    def _step(self, slot: _Slot, skip: LayerSkip | None, want_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over ``slot``'s inputs: the final normed states and the logits of all ``step_rows`` rows
        (static buffers when replayed: read them before the next step)."""
        if skip is not None or not (self.graphs or self.compiled):
            states = self._layers(slot, skip)
            return states, (self.head(states) if want_logits else states)
        if not self.graphs:
            return self._step_function(slot)
        if slot.graph is None:
            self._capture(slot)
        slot.graph.replay()
        return slot.states, slot.logits

    def _capture(self, slot: _Slot) -> None:
        """Capture ``slot``'s step as a CUDA graph (after warm-up runs on a side stream, as CUDA graphs need)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # The inputs as they are (set for the step about to run) are replayed by the warm-ups too: they rewrite
        # the same keys and values, so running them is harmless.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # (the first compiles the step, where it is compiled)
                self._step_function(slot)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            states, logits = self._step_function(slot)
        slot.graph, slot.states, slot.logits = graph, states, logits

    def _full_step(self, slot: _Slot) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step over ``slot``'s inputs, no layer skipped: the final normed states and the logits."""
        states = self._layers(slot, None)
        return states, self.head(states)

    def _layers(self, slot: _Slot, skip: LayerSkip | None) -> torch.Tensor:
        """The decoder layers over the step's rows; returns the final normed states ``(step_rows, hidden)``."""
        inputs, step = slot.inputs, self.step_rows
        tokens, positions = inputs[:step], inputs[step : 2 * step]
        written, committed = inputs[2 * step : 3 * step], inputs[3 * step]
        # Each row's window starts at a block boundary fixed by its own position, at least TREE_DEPTH before it:
        # every position before the window is committed whatever the step, and the window holds the row's path.
        window_start = ((positions - (TREE_DEPTH - 1)).div(BLOCK, rounding_mode="floor") * BLOCK).clamp(min=0)
        window = window_start[:, None] + self._window_offsets  # (rows, WINDOW) positions
        in_window = window <= positions[:, None]
        relative = window - committed
        path = slot.path.gather(1, relative.clamp(0, TREE_DEPTH - 1))
        window_slots = torch.where(relative < 0, window, committed + path).clamp(max=self.positions - 1)
        before = self._columns[None, :] < window_start[:, None]  # (rows, positions) committed part seen
        span_mask = torch.zeros(before.shape, dtype=self.dtype, device=self.device).masked_fill_(~before, float("-inf"))
        parts = _Parts(span_mask.repeat(self.group, 1)[None, None], window_slots.reshape(-1), in_window)
        cos, sin = self.cos[positions][:, None], self.signed_sin[positions][:, None]
        hidden = self.embedding[tokens]
        skip_attention = skip.attention if skip is not None else frozenset()
        skip_mlp = skip.mlp if skip is not None else frozenset()
        for index, layer in enumerate(self.layers):
            if index not in skip_attention:
                hidden = hidden + self._path_attention(index, layer, hidden, slot, written, cos, sin, parts)
            if index not in skip_mlp:
                hidden = hidden + self._mlp(layer, hidden)
        return self._rms_norm(hidden, self.norm)

    def _path_attention(self, index, layer, hidden, slot, written, cos, sin, parts: _Parts) -> torch.Tensor:
        """One layer's attention sub-layer (without its residual): the rows' keys and values written at their
        slots, then each row over the positions before its window (in place, one product for every row) and over
        its window (gathered per row, so that its path's keys sit at their positions, as in plain decoding); the
        two parts share one maximum and one normaliser."""
        heads, kv_heads, head_dim, group, step = self.heads, self.kv_heads, self.head_dim, self.group, self.step_rows
        qkv = layer.qkv(self._rms_norm(hidden, layer.attention_norm))
        query_key = self._rotate(qkv[:, : (heads + kv_heads) * head_dim].view(step, heads + kv_heads, head_dim),
                                 cos, sin)
        values = qkv[:, (heads + kv_heads) * head_dim :].view(step, kv_heads, head_dim)
        keys_cache, values_cache = slot.keys[index], slot.values[index]  # (kv_heads, positions, head_dim)
        keys_cache.index_copy_(1, written, query_key[:, heads:].transpose(0, 1))
        values_cache.index_copy_(1, written, values.transpose(0, 1))
        queries = query_key[:, :heads].reshape(step, kv_heads, group, head_dim)
        # Before the window: every key/value head with its group's query rows as one batch entry.
        span_output, span_log_sum = self._span_part(
            queries.permute(1, 2, 0, 3).reshape(1, kv_heads, group * step, head_dim), keys_cache[None],
            values_cache[None], parts.span_mask)
        span_output = span_output.view(kv_heads, group, step, head_dim).permute(2, 0, 1, 3).float()
        span_log_sum = span_log_sum.view(kv_heads, group, step).permute(2, 0, 1)  # (rows, kv, group)
        # The window: (rows, kv, WINDOW, dim) keys and values along each row's own path.
        window_keys = keys_cache.index_select(1, parts.window_slots).view(kv_heads, step, WINDOW, head_dim)
        window_values = values_cache.index_select(1, parts.window_slots).view(kv_heads, step, WINDOW, head_dim)
        scores = torch.matmul(queries, window_keys.transpose(0, 1).transpose(2, 3)).float() * self.scale
        scores = scores.masked_fill(~parts.in_window[:, None, None, :], float("-inf"))  # (rows, kv, group, WINDOW)
        maximum = torch.maximum(scores.amax(-1), span_log_sum)
        weights = torch.exp(scores - maximum[..., None])
        span_weight = torch.exp(span_log_sum - maximum)  # 0 where nothing lies before the window
        window_sum = torch.matmul(weights.to(self.dtype), window_values.transpose(0, 1)).float()
        total = span_output.nan_to_num() * span_weight[..., None] + window_sum
        output = (total / (weights.sum(-1) + span_weight)[..., None]).to(self.dtype)
        return layer.output(output.reshape(step, heads * head_dim))

    def _span_part(self, queries, keys, values, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``queries`` over ``keys`` with an additive ``mask``: the normalised output and each row's
        log-sum-exp of its scores (``-inf`` where the mask hides everything)."""
        scores = torch.matmul(queries, keys.transpose(2, 3)).float() * self.scale + mask
        log_sum = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - log_sum.nan_to_num(neginf=0.0)[..., None])
        return torch.matmul(weights.to(self.dtype), values), log_sum


@dataclass
class _Parts:
    """What every layer's attention of one step shares (see :meth:`GraphedLeanTarget._layers`)."""

    span_mask: torch.Tensor  # (1, 1, group * rows, positions): 0 before each row's window, -inf from it on
    window_slots: torch.Tensor  # (rows * WINDOW,): cache slot of each row's window positions
    in_window: torch.Tensor  # (rows, WINDOW): which window positions the row sees (up to its own)


def _tree_paths(parents: Sequence[int], depths: Sequence[int]) -> torch.Tensor:
    """``(rows, TREE_DEPTH)``: for each row, the block row of its ancestor at each depth, itself at its own."""
    paths = torch.zeros(len(parents), TREE_DEPTH, dtype=torch.long)
    for row, (parent, depth) in enumerate(zip(parents, depths)):
        if parent != CACHE:
            paths[row] = paths[parent]
        paths[row, depth] = row
    return paths


def lean_target(model: Any, **options: Any) -> LeanTarget:
    """The lean forward for ``model``: :class:`GraphedLeanTarget` on CUDA devices, :class:`LeanTarget` elsewhere
    (``options`` go to the chosen class)."""
    if model_device(model).type == "cuda":
        return GraphedLeanTarget(model, **options)
    return LeanTarget(model, **options)


