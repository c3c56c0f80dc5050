"""The KV caches: where a sequence's keys and values live, and why rejecting draft rows is a cheap rollback.

Both caches preallocate their buffers; a forward writes its new rows right after a sequence's committed length, and
nothing is committed until the engine keeps the accepted rows, which are compacted into place. Rejected rows are
simply left behind the committed length and overwritten by the next step.

- :class:`TreeKVCache` serves :class:`~draftwise.backend.target.TransformersTarget` (any transformers causal LM, through
  its public :class:`~transformers.Cache` interface). Each layer keeps one ``(batch, kv_heads, capacity, head_dim)``
  buffer. Sequences in a batch may have different committed lengths (``lengths``); a forward writes sequence ``b``'s
  new rows at ``lengths[b]``, and the engine's attention mask hides everything a row must not see, including the
  stale slots of shorter sequences.
- :class:`LeanCache` serves the lean forward (:mod:`draftwise.backend.forward.lean`): one sequence's keys and values
  in blocks of positions, laid out so that attention reads whole blocks in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import UnsupportedModelError


class _BufferLayer(CacheLayerMixin):
    """One attention layer's slice of a :class:`TreeKVCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: TreeKVCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        capacity = self._owner.capacity
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((batch, heads, capacity, key_dim))
        self.values = value_states.new_zeros((batch, heads, capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_rows = key_states.shape[-2]
        lengths = self._owner.lengths
        end = max(lengths) + new_rows
        if end > self.keys.shape[-2]:
            self._grow(end)
        if len(lengths) == 1:
            start = lengths[0]
            self.keys[:, :, start : start + new_rows] = key_states
            self.values[:, :, start : start + new_rows] = value_states
        else:
            for row, start in enumerate(lengths):
                self.keys[row, :, start : start + new_rows] = key_states[row]
                self.values[row, :, start : start + new_rows] = value_states[row]
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys.shape[-2])
        keys = self.keys.new_zeros((*self.keys.shape[:2], capacity, self.keys.shape[-1]))
        values = self.values.new_zeros((*self.values.shape[:2], capacity, self.values.shape[-1]))
        keys[:, :, : self.keys.shape[-2]] = self.keys
        values[:, :, : self.values.shape[-2]] = self.values
        self.keys, self.values = keys, values
        self._owner.capacity = max(self._owner.capacity, capacity)

    def compact(self, row: int, start: int, keep: torch.Tensor) -> None:
        """Move the slots ``start + keep`` of sequence ``row`` to ``start, start + 1, ...``."""
        destination = slice(start, start + keep.numel())
        source = keep + start
        # index_select copies before writing, so overlapping source and destination are safe.
        self.keys[row, :, destination] = self.keys[row].index_select(1, source)
        self.values[row, :, destination] = self.values[row].index_select(1, source)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(self._owner.lengths) + query_length, 0

    def get_seq_length(self) -> int:
        return max(self._owner.lengths)

    def get_max_length(self) -> int:
        return -1


class TreeKVCache(Cache):
    """KV cache with per-sequence committed lengths, cheap rollback and compaction of accepted tree nodes.

    Args:
        num_layers: number of attention layers of the model.
        batch_size: number of sequences.
        capacity: initial number of slots per sequence; the buffers grow (by doubling) if a forward needs more.
    """

    def __init__(self, num_layers: int, batch_size: int = 1, capacity: int = 256) -> None:
        self.capacity = capacity
        self.lengths: list[int] = [0] * batch_size
        super().__init__(layers=[_BufferLayer(self) for _ in range(num_layers)])

    def keep(self, row: int, keep: Sequence[int] | torch.Tensor) -> None:
        """Commit, for sequence ``row``, the rows ``keep`` (ascending, relative to the last forward's first new row).

        Everything else written by the last forward for that sequence is dropped.
        """
        start = self.lengths[row]
        count = len(keep)
        if count and not _is_prefix_range(keep):
            index = torch.as_tensor(keep, dtype=torch.long, device=self.layers[0].keys.device)
            for layer in self.layers:
                layer.compact(row, start, index)
        self.lengths[row] = start + count

    def truncate(self, row: int, length: int) -> None:
        """Roll sequence ``row`` back to ``length`` committed slots."""
        if length > self.lengths[row]:
            raise ValueError(f"cannot truncate to {length}: only {self.lengths[row]} slots are committed")
        self.lengths[row] = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths)


def check_full_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose layers are not all full attention: the engine's masks could not express them."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    unsupported = sorted({kind for kind in layer_types if kind != "full_attention"})
    # A window only matters when it is switched on (qwen2 carries one with use_sliding_window=False) and is
    # shorter than the context; the engine's masks are full attention, so such a model must be refused.
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    context = getattr(config, "max_position_embeddings", None)
    if window is not None and (context is None or window < context):
        unsupported = unsupported or ["sliding_attention"]
    if unsupported:
        raise UnsupportedModelError(
            f"{config.model_type} uses layer types {unsupported}; "
            "draftwise's engine needs every layer to be full attention"
        )


def _is_prefix_range(indices: Sequence[int] | torch.Tensor) -> bool:
    """True when ``indices`` is exactly 0, 1, ..., n-1 (nothing to move)."""
    if isinstance(indices, torch.Tensor):
        indices = indices.tolist()
    return all(index == position for position, index in enumerate(indices))


class LeanCache:
    """Keys and values of one sequence for the lean forward, in blocks of positions: ``(layers, blocks, kv_heads, block, head_dim)``
    buffers (block-major, so that attention reads whole blocks in place), grown when needed.

    Positions ``0 .. length - 1`` are committed; a forward writes its rows after them and :meth:`~draftwise.backend.forward.lean.LeanTarget.commit`
    moves the accepted ones into place.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, block: int, capacity: int, dtype, device) -> None:
        blocks = -(-capacity // block)
        shape = (layers, blocks, kv_heads, block, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block = block
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1] * self.block

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` positions (doubling, so growth is rare)."""
        if needed <= self.capacity:
            return
        blocks = max(-(-needed // self.block), 2 * self.keys.shape[1])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], blocks, *old.shape[2:]))
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def region(self, start: int, end: int) -> tuple[slice, slice]:
        """An index of ``keys`` and ``values`` covering positions ``start .. end - 1`` of every layer (whole
        blocks)."""
        return slice(None), slice(start // self.block, (end - 1) // self.block + 1)

    def move(self, sources: torch.Tensor, start: int) -> None:
        """Copy the positions ``sources`` of every layer to ``start, start + 1, ...`` (sources read first)."""
        targets = torch.arange(start, start + sources.shape[0], device=sources.device)
        for buffer in (self.keys, self.values):
            buffer[:, targets // self.block, :, targets % self.block] = buffer[
                :, sources // self.block, :, sources % self.block
            ]

    def _pieces(self, start: int, end: int):
        """``(block, offset, count, done)`` for each block that positions ``start .. end - 1`` fall in."""
        position = start
        while position < end:
            offset = position % self.block
            count = min(self.block - offset, end - position)
            yield position // self.block, offset, count, position - start
            position += count

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions ``start .. end - 1`` of every layer: ``(layers, kv_heads, end - start, head_dim)``."""
        pieces = list(self._pieces(start, end))
        return tuple(  # type: ignore[return-value]
            torch.cat([buffer[:, block, :, offset : offset + count] for block, offset, count, _ in pieces], dim=2)
            if len(pieces) > 1 else buffer[:, pieces[0][0], :, pieces[0][1] : pieces[0][1] + pieces[0][2]].clone()
            for buffer in (self.keys, self.values)
        )

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``(layers, kv_heads, positions, head_dim)`` keys and values at positions ``start ..``."""
        self.reserve(start + keys.shape[2])
        for block, offset, count, done in self._pieces(start, start + keys.shape[2]):
            self.keys[:, block, :, offset : offset + count] = keys[:, :, done : done + count]
            self.values[:, block, :, offset : offset + count] = values[:, :, done : done + count]
