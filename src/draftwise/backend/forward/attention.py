"""Attention whose result for a row does not depend on which other rows share the forward.

A verification forward computes many rows at once: the last emitted token and the draft nodes below it. For its
output to be exactly what plain decoding computes one row at a time, every row's attention must be the same
arithmetic, in the same order, whatever the rest of the forward holds. Library attention kernels do not promise
that: their results move with the number of query rows, the number of keys (masked ones included) and where the
visible keys sit in the buffer, so a draft node whose ancestors are scattered among its siblings' slots gets a
slightly different result than the same position in plain decoding.

Here a row's attention is defined canonically, as a function of its own position ``p`` alone:

- the keys are the row's sequence at positions ``0..p``, cut into blocks of ``block`` positions aligned to
  position 0 (block ``b`` holds positions ``b * block .. (b + 1) * block - 1``; positions after ``p`` are masked);
- each block's scores, exponentials and value sums are computed by fixed-shape products (``block`` keys, one head
  group of query rows), with ``m`` the row's maximum score over all its positions (a maximum is exact in any order);
- the blocks' sums are added in block order by a sequential scan.

Blocks below the committed length are the same for every row of a sequence: they are read in place from the cache
and computed for all rows in one product (``shared`` blocks). Blocks from there on hold each row's own ancestors:
their keys are gathered per row (``tail`` blocks). The two kinds run through the same shaped products, so a block
gives the same numbers whichever kind it is; and masked positions contribute exact zeros. Whether the machine's
matrix kernels really give a row the same result whatever the number of rows is measured, not assumed
(:mod:`draftwise.backend.calibration.invariance`): products are padded to a row count from which they do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TailLayout:
    """Where each row's keys come from, for one verification forward of one sequence.

    Attributes:
        length: committed positions in the cache.
        shared_blocks: full blocks below ``length`` (read in place: positions ``0 .. shared_blocks * block``).
        tail_blocks: blocks per row from there on.
        gather: ``(kv_heads * rows * tail_blocks * block,)`` row of the flattened block-major cache
            (``(blocks * kv_heads * block, head_dim)``) holding each tail position of each row, per key/value head.
        masked: ``(rows, tail_blocks * block)`` positions a row must not see (after it, or padding).
    """

    length: int
    shared_blocks: int
    tail_blocks: int
    gather: torch.Tensor
    masked: torch.Tensor


def tail_layout(
    length: int, parents: Sequence[int], block: int, kv_heads: int, device: torch.device | str = "cpu"
) -> TailLayout:
    """The key layout of rows with ``parents`` (see :mod:`draftwise.backend.rows`) written at cache slots
    ``length, length + 1, ...``: each row's path from its first ancestor down to itself, at its positions, in a
    block-major cache of ``kv_heads`` heads."""
    rows = len(parents)
    paths: list[list[int]] = []
    for row, parent in enumerate(parents):
        paths.append([row] if parent < 0 else [*paths[parent], row])
    shared_blocks = length // block
    start = shared_blocks * block
    committed = length - start
    deepest = max(len(path) for path in paths)
    tail_blocks = -(-(committed + deepest) // block)
    width = tail_blocks * block
    slots = np.zeros((rows, width), dtype=np.int64)
    visible = np.zeros((rows, width), dtype=bool)
    slots[:, :committed] = np.arange(start, length)
    visible[:, :committed] = True
    for row, path in enumerate(paths):
        slots[row, committed : committed + len(path)] = np.asarray(path) + length
        visible[row, committed : committed + len(path)] = True
    heads = np.arange(kv_heads)[:, None, None]
    gather = (slots // block)[None] * (kv_heads * block) + heads * block + (slots % block)[None]
    return TailLayout(
        length,
        shared_blocks,
        tail_blocks,
        torch.from_numpy(gather.reshape(-1)).to(device),
        torch.from_numpy(~visible).to(device),
    )


def pad_rows(tensor: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended along ``dim`` up to ``rows`` (unchanged when it has as many)."""
    missing = rows - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim)


def block_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: TailLayout,
    min_rows: int = 1,
) -> torch.Tensor:
    """Canonical attention of ``query`` rows over their own keys (see the module docstring).

    Args:
        query: ``(rows, kv_heads, group, head_dim)``, already scaled and rotated.
        keys, values: the sequence's cache of one layer in blocks, ``(blocks, kv_heads, block, head_dim)``, holding
            the committed positions and this forward's rows at ``layout.length ..``.
        layout: where each row's keys come from.
        min_rows: products are padded to at least this many query rows (the machine's invariant row count).

    Returns:
        ``(rows, kv_heads * group * head_dim)`` in the query's dtype.
    """
    rows, kv_heads, group, head_dim = query.shape
    block = keys.shape[2]
    dtype = query.dtype
    tail = layout.tail_blocks
    grouped = query.permute(1, 0, 2, 3)  # (kv, rows, group, dim)

    # Tail blocks: each row's own keys, products of one row's head group at a time.
    tail_keys = keys.view(-1, head_dim).index_select(0, layout.gather).view(-1, block, head_dim)
    tail_values = values.view(-1, head_dim).index_select(0, layout.gather).view(-1, block, head_dim)
    tail_rows = max(group, min_rows)
    tail_query = pad_rows(grouped, 2, tail_rows)[:, :, None]  # (kv, rows, 1, tail_rows, dim)
    tail_query = tail_query.expand(kv_heads, rows, tail, tail_rows, head_dim).reshape(-1, tail_rows, head_dim)
    tail_scores = torch.bmm(tail_query, tail_keys.transpose(1, 2)).float()
    tail_scores = tail_scores.view(kv_heads, rows, tail, tail_rows, block)
    tail_scores = tail_scores.masked_fill(layout.masked.view(1, rows, tail, 1, block), float("-inf"))
    maximum = tail_scores.amax(dim=(2, 4))[:, :, :group]  # (kv, rows, group)

    # Shared blocks: every row sees all of them; all rows' queries in one product per block and head.
    shared = layout.shared_blocks
    if shared:
        shared_rows = max(rows * group, min_rows)
        shared_query = pad_rows(grouped.reshape(kv_heads, rows * group, head_dim), 1, shared_rows)
        shared_query = shared_query[None].expand(shared, kv_heads, shared_rows, head_dim).reshape(-1, shared_rows, head_dim)
        shared_keys = keys[:shared].view(shared * kv_heads, block, head_dim)
        shared_scores = torch.bmm(shared_query, shared_keys.transpose(1, 2)).float()
        shared_scores = shared_scores.view(shared, kv_heads, shared_rows, block)
        shared_maximum = shared_scores[:, :, : rows * group].amax(dim=(0, 3)).view(kv_heads, rows, group)
        maximum = torch.maximum(maximum, shared_maximum)

    tail_weights = torch.exp(tail_scores - pad_rows(maximum, 2, tail_rows)[:, :, None, :, None])
    tail_sums = torch.bmm(tail_weights.to(dtype).view(-1, tail_rows, block), tail_values)
    tail_sums = tail_sums.float().view(kv_heads, rows, tail, tail_rows, head_dim)[:, :, :, :group]
    block_sums = tail_sums.transpose(2, 3)  # (kv, rows, group, tail blocks, dim)
    block_totals = tail_weights.sum(-1)[:, :, :, :group].transpose(2, 3)  # (kv, rows, group, tail blocks)
    if shared:
        flat_maximum = pad_rows(maximum.reshape(kv_heads, rows * group), 1, shared_rows)
        shared_weights = torch.exp(shared_scores - flat_maximum[None, :, :, None])
        shared_sums = torch.bmm(
            shared_weights.to(dtype).view(-1, shared_rows, block), values[:shared].view(shared * kv_heads, block, head_dim)
        ).float().view(shared, kv_heads, shared_rows, head_dim)[:, :, : rows * group]
        shared_totals = shared_weights.sum(-1)[:, :, : rows * group]
        shared_sums = shared_sums.view(shared, kv_heads, rows, group, head_dim).permute(1, 2, 3, 0, 4)
        shared_totals = shared_totals.view(shared, kv_heads, rows, group).permute(1, 2, 3, 0)
        block_sums = torch.cat([shared_sums, block_sums], 3)
        block_totals = torch.cat([shared_totals, block_totals], 3)
    # Blocks are added in order, one after the other: the same additions whoever else is in the forward.
    total = block_sums.cumsum(3)[:, :, :, -1]
    weight = block_totals.cumsum(3)[:, :, :, -1]
    output = (total / weight[..., None]).to(dtype)  # (kv, rows, group, dim)
    return output.permute(1, 0, 2, 3).reshape(rows, kv_heads * group * head_dim)


def single_row_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, min_rows: int = 1
) -> torch.Tensor:
    """:func:`block_attention` of one row at position ``length`` (plain one-row decoding), in fewer operations.

    A lone row's tail is the block its own position falls in, so every block it sees lies in place in the cache and
    all of them run through one product; each product has the shape :func:`block_attention` gives both its kinds of
    block for one row (one head group of query rows, padded to ``min_rows``), the masked positions are the same and
    the blocks are added in the same order, so the result is bitwise :func:`block_attention`'s.

    Args:
        query: ``(1, kv_heads, group, head_dim)``, scaled and rotated.
        keys, values: the sequence's cache of one layer, ``(blocks, kv_heads, block, head_dim)``, with the row's own
            key and value written at ``length``.
        length: committed positions before the row.
        min_rows: as for :func:`block_attention`.
    """
    _, kv_heads, group, head_dim = query.shape
    block = keys.shape[2]
    count = length // block + 1
    rows = max(group, min_rows)
    grouped = pad_rows(query[0], 1, rows)  # (kv, rows, dim)
    scores = torch.matmul(grouped[None], keys[:count].transpose(2, 3)).float()  # (blocks, kv, rows, block)
    scores[-1, :, :, length - (count - 1) * block + 1 :] = float("-inf")
    maximum = pad_rows(scores[:, :, :group].amax(dim=(0, 3)), 1, rows)  # (kv, rows)
    weights = torch.exp(scores - maximum[None, :, :, None])
    sums = torch.matmul(weights.to(query.dtype), values[:count]).float()  # (blocks, kv, rows, dim)
    # Blocks added in order, as block_attention adds them.
    total = sums.cumsum(0)[-1, :, :group]
    weight = weights.sum(-1).cumsum(0)[-1, :, :group]
    return (total / weight[..., None]).to(query.dtype).reshape(1, kv_heads * group * head_dim)


@dataclass(frozen=True)
class RowsLayout:
    """Where the key blocks of several sequences' chains of rows come from, for :func:`rows_attention` (computed
    once per forward, used by every layer).

    A chain's rows (each follows the one before it: plain decoding's lone row, a draft chain) are written at their
    own positions, so every block a row sees is its sequence's cache block as it is (no per-row gathers); the rows of
    a sequence differ only in which positions they see. Each sequence's blocks, up to the last one its deepest row
    sees, are concatenated over the sequences (one sequence's are read in place).

    Attributes:
        counts: blocks of each sequence.
        rows: query rows of every product: the longest chain times the head group, at least ``min_rows``.
        chain_rows: the longest chain (each sequence's rows are padded to it).
        query_index: ``(sequences * chain_rows,)`` flat row behind each padded row (``None``: one row each).
        output_index: ``(flat rows,)`` padded row of each flat row (``None``: one row each).
        sequence_of_block: ``(blocks,)`` the sequence of each concatenated block.
        slots: ``(blocks,)`` each block's place in a ``(sequences * most blocks)`` padded layout.
        masked: ``(blocks, 1, rows, block)`` positions each query row must not see.
        new_slots: ``(flat rows * kv_heads,)`` row of the flattened concatenated blocks (``(blocks * kv_heads *
            block, head_dim)``) where each flat row's key (or value) of each head goes.
    """

    counts: tuple[int, ...]
    rows: int
    chain_rows: int
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None
    sequence_of_block: torch.Tensor
    slots: torch.Tensor
    masked: torch.Tensor
    new_slots: torch.Tensor

    @property
    def most_blocks(self) -> int:
        return max(self.counts)


def rows_layout(
    lengths: Sequence[int],
    sizes: Sequence[int],
    block: int,
    kv_heads: int,
    group: int,
    min_rows: int = 1,
    device: torch.device | str = "cpu",
) -> RowsLayout:
    """The :class:`RowsLayout` of chains of ``sizes[i]`` rows written at positions ``lengths[i], lengths[i] + 1,
    ...``, for products of ``group`` query rows per row over ``kv_heads`` key/value heads."""
    if len(lengths) != len(sizes) or not sizes or min(sizes) < 1:
        raise ValueError(f"one chain of at least one row per sequence: lengths {list(lengths)}, sizes {list(sizes)}")
    chain_rows = max(sizes)
    rows = max(chain_rows * group, min_rows)
    counts = [(length + size - 1) // block + 1 for length, size in zip(lengths, sizes)]
    masks = []
    for length, size, count in zip(lengths, sizes, counts):
        # Row r sees every position up to its own, length + r; padding rows see position 0, so their sums stay finite.
        seen = np.arange(count * block)[None] <= length + np.arange(size)[:, None]
        visible = np.zeros((count, rows, block), dtype=bool)
        visible[:, : size * group] = np.repeat(seen.reshape(size, count, block).transpose(1, 0, 2), group, axis=1)
        visible[0, size * group :, 0] = True
        masks.append(~visible)
    most = max(counts)
    first_blocks = np.cumsum([0, *counts[:-1]])
    positions = np.concatenate([length + np.arange(size) for length, size in zip(lengths, sizes)])
    firsts = np.repeat(first_blocks, sizes)
    heads = np.arange(kv_heads)[None]
    new_slots = ((firsts + positions // block) * kv_heads * block)[:, None] + heads * block + (positions % block)[:, None]
    query_index = output_index = None
    if chain_rows > 1:
        starts = np.cumsum([0, *sizes])
        query_index = np.concatenate([np.minimum(np.arange(chain_rows), size - 1) + start
                                      for size, start in zip(sizes, starts)])
        output_index = np.concatenate([index * chain_rows + np.arange(size) for index, size in enumerate(sizes)])

    def as_tensor(array: np.ndarray | None) -> torch.Tensor | None:
        return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return RowsLayout(
        tuple(counts),
        rows,
        chain_rows,
        as_tensor(query_index),
        as_tensor(output_index),
        as_tensor(np.repeat(np.arange(len(counts)), counts)),
        as_tensor(np.concatenate([index * most + np.arange(count) for index, count in enumerate(counts)])),
        as_tensor(np.concatenate(masks)[:, None]),
        as_tensor(new_slots.reshape(-1)),
    )


def rows_attention(
    query: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    layout: RowsLayout,
    new_keys: torch.Tensor | None = None,
    new_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`block_attention` of the chains of rows of several sequences in one set of products, each row bitwise
    its result alone and plain decoding's at its position: every block runs through products of one shape (the head
    groups of the longest chain's rows against one block, at least the machine's invariant row count, see
    :mod:`draftwise.backend.calibration.invariance`); a row's maximum is taken over its own positions; its block sums are added
    in order by a sequential scan, in which the blocks it does not see (a shorter chain's, padding) add exact zeros.

    Args:
        query: ``(flat rows, kv_heads, group, head_dim)``: every sequence's rows, one sequence after the other.
        keys, values: each sequence's cache of this layer, ``(blocks, kv_heads, block, head_dim)``, holding this
            forward's rows at their positions.
        layout: see :func:`rows_layout`.
        new_keys, new_values: ``(flat rows, kv_heads, head_dim)``: this forward's rows' keys and values when the
            caches do not hold them yet (they are written into the concatenated copy of the blocks instead, so that
            the caches can be written once per forward rather than once per layer; several sequences only).

    Returns:
        ``(flat rows, kv_heads * group * head_dim)``.
    """
    count = len(keys)
    _, kv_heads, group, head_dim = query.shape
    dtype = query.dtype
    rows, most = layout.rows, layout.most_blocks
    if new_keys is not None and count == 1:
        raise ValueError("one sequence's blocks are read in place: write its rows into its cache")
    if layout.query_index is None:
        grouped = pad_rows(query, 2, rows)  # (sequences, kv, rows, dim)
    else:
        chain_rows = layout.chain_rows
        grouped = query.index_select(0, layout.query_index).view(count, chain_rows, kv_heads, group, head_dim)
        grouped = pad_rows(grouped.transpose(1, 2).reshape(count, kv_heads, chain_rows * group, head_dim), 2, rows)
    if count == 1:
        own_keys, own_values = keys[0][: layout.counts[0]], values[0][: layout.counts[0]]
    else:
        own_keys = torch.cat([own[:blocks] for own, blocks in zip(keys, layout.counts)])
        own_values = torch.cat([own[:blocks] for own, blocks in zip(values, layout.counts)])
        if new_keys is not None and new_values is not None:
            own_keys.view(-1, head_dim).index_copy_(0, layout.new_slots, new_keys.reshape(-1, head_dim))
            own_values.view(-1, head_dim).index_copy_(0, layout.new_slots, new_values.reshape(-1, head_dim))
    block_queries = grouped.index_select(0, layout.sequence_of_block)  # (blocks, kv, rows, dim)
    scores = torch.matmul(block_queries, own_keys.transpose(2, 3)).float().masked_fill_(layout.masked, float("-inf"))
    block_maximum = scores.amax(-1)  # (blocks, kv, rows)
    if count == 1:
        maximum = block_maximum.amax(0)[None]
    else:
        maximum = block_maximum.new_full((count * most, kv_heads, rows), float("-inf"))
        maximum = maximum.index_copy_(0, layout.slots, block_maximum).view(count, most, kv_heads, rows).amax(1)
    weights = torch.exp(scores - maximum.index_select(0, layout.sequence_of_block)[..., None])
    sums = torch.matmul(weights.to(dtype), own_values).float()  # (blocks, kv, rows, dim)
    totals = weights.sum(-1)
    # Blocks added in order, one after the other (blocks a row does not see, and padding, add exact zeros).
    if count == 1:
        total, weight = sums.cumsum(0)[-1:], totals.cumsum(0)[-1:]
    else:
        padded_sums = sums.new_zeros(count * most, kv_heads, rows, head_dim).index_copy_(0, layout.slots, sums)
        padded_totals = totals.new_zeros(count * most, kv_heads, rows).index_copy_(0, layout.slots, totals)
        total = padded_sums.view(count, most, kv_heads, rows, head_dim).cumsum(1)[:, -1]
        weight = padded_totals.view(count, most, kv_heads, rows).cumsum(1)[:, -1]
    output = (total / weight[..., None]).to(dtype)  # (sequences, kv, rows, dim)
    if layout.query_index is None:
        return output[:, :, :group].reshape(count, kv_heads * group * head_dim)
    chain_rows = layout.chain_rows
    output = output[:, :, : chain_rows * group].reshape(count, kv_heads, chain_rows, group, head_dim)
    output = output.transpose(1, 2).reshape(count * chain_rows, kv_heads * group * head_dim)
    return output.index_select(0, layout.output_index)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of a prompt over itself (the prefill, shared by plain and speculative decoding alike).

    Args:
        query: ``(rows, heads, head_dim)``, scaled and rotated; keys and values ``(rows, kv_heads, head_dim)``.
    """
    rows, heads, head_dim = query.shape
    output = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        is_causal=True, scale=1.0, enable_gqa=True,
    )
    return output[0].transpose(0, 1).reshape(rows, heads * head_dim)


@dataclass(frozen=True)
class BatchLayout:
    """Several sequences' layouts padded to common shapes, so that their attention runs as one set of products.

    Padding only ever adds exact zeros in places a row's own sums do not see change: padded tail and shared blocks
    are masked (weight exactly 0, appended after or between the row's real blocks in the ordered sum), padded query
    rows are dropped at the end, and the products' row counts are padded as for one sequence (to at least
    ``min_rows``, from which the machine's products are measured invariant). A row's result is therefore bitwise
    its result in the sequence's own forward.

    Attributes:
        rows, shared_blocks, tail_blocks: the common row count and block counts (the largest of the sequences).
        shared_counts: each sequence's own shared block count.
        query_index: ``(sequences * rows,)`` flat row of each padded row (padding points at row 0).
        output_index: ``(flat rows,)`` padded row of each flat row.
        gathers: per sequence, its tail gather (as :attr:`TailLayout.gather`) padded to the common shape.
        tail_masked: ``(sequences, rows, tail_blocks, block)``; shared_masked: ``(sequences, shared_blocks)``.
    """

    rows: int
    shared_blocks: int
    tail_blocks: int
    shared_counts: tuple[int, ...]
    query_index: torch.Tensor
    output_index: torch.Tensor
    gathers: tuple[torch.Tensor, ...]
    tail_masked: torch.Tensor
    shared_masked: torch.Tensor


def batch_layout(layouts: Sequence[TailLayout], row_counts: Sequence[int], block: int, kv_heads: int) -> BatchLayout:
    """The common layout of several sequences' forwards (``row_counts[i]`` rows laid out by ``layouts[i]``)."""
    count = len(layouts)
    rows = max(row_counts)
    shared = max(layout.shared_blocks for layout in layouts)
    tail = max(layout.tail_blocks for layout in layouts)
    device = layouts[0].gather.device
    starts = np.cumsum([0, *row_counts])
    query_index = np.zeros((count, rows), dtype=np.int64)
    output_index = np.zeros(starts[-1], dtype=np.int64)
    tail_masked = torch.ones(count, rows, tail, block, dtype=torch.bool, device=device)
    shared_masked = torch.ones(count, max(shared, 1), dtype=torch.bool, device=device)
    gathers = []
    for index, (layout, own_rows) in enumerate(zip(layouts, row_counts)):
        query_index[index, :own_rows] = np.arange(starts[index], starts[index + 1])
        output_index[starts[index] : starts[index + 1]] = index * rows + np.arange(own_rows)
        own_tail = layout.tail_blocks
        tail_masked[index, :own_rows, :own_tail] = layout.masked.view(own_rows, own_tail, block)
        shared_masked[index, : layout.shared_blocks] = False
        gather = layout.gather.new_zeros(kv_heads, rows, tail, block)
        gather[:, :own_rows, :own_tail] = layout.gather.view(kv_heads, own_rows, own_tail, block)
        gathers.append(gather.view(-1))
    return BatchLayout(
        rows,
        shared,
        tail,
        tuple(layout.shared_blocks for layout in layouts),
        torch.from_numpy(query_index.reshape(-1)).to(device),
        torch.from_numpy(output_index).to(device),
        tuple(gathers),
        tail_masked,
        shared_masked,
    )


def batch_block_attention(
    query: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    layout: BatchLayout,
    shared_buffers: tuple[torch.Tensor, torch.Tensor] | None,
    min_rows: int = 1,
) -> torch.Tensor:
    """:func:`block_attention` of several sequences in one set of products, each row bitwise its own sequence's
    result (see :class:`BatchLayout`).

    Args:
        query: ``(flat rows, kv_heads, group, head_dim)``: every sequence's rows, one sequence after the other.
        keys, values: each sequence's cache of this layer, ``(blocks, kv_heads, block, head_dim)``.
        layout: the common layout (:func:`batch_layout`).
        shared_buffers: two zeroed ``(sequences, shared_blocks, kv_heads, block, head_dim)`` buffers the shared
            blocks are copied into (their padding stays zero); ``None`` when no sequence has shared blocks.
        min_rows: as for :func:`block_attention`.

    Returns:
        ``(flat rows, kv_heads * group * head_dim)``.
    """
    count = len(keys)
    _, kv_heads, group, head_dim = query.shape
    block = keys[0].shape[2]
    dtype = query.dtype
    rows, shared, tail = layout.rows, layout.shared_blocks, layout.tail_blocks
    grouped = query.index_select(0, layout.query_index).view(count, rows, kv_heads, group, head_dim).transpose(1, 2)

    tail_keys = torch.stack([own.reshape(-1, head_dim).index_select(0, gather) for own, gather in zip(keys, layout.gathers)])
    tail_values = torch.stack(
        [own.reshape(-1, head_dim).index_select(0, gather) for own, gather in zip(values, layout.gathers)]
    )
    tail_rows = max(group, min_rows)
    tail_query = pad_rows(grouped, 3, tail_rows)[:, :, :, None]  # (n, kv, rows, 1, tail_rows, dim)
    tail_query = tail_query.expand(count, kv_heads, rows, tail, tail_rows, head_dim).reshape(-1, tail_rows, head_dim)
    tail_scores = torch.bmm(tail_query, tail_keys.view(-1, block, head_dim).transpose(1, 2)).float()
    tail_scores = tail_scores.view(count, kv_heads, rows, tail, tail_rows, block)
    tail_scores = tail_scores.masked_fill(layout.tail_masked.view(count, 1, rows, tail, 1, block), float("-inf"))
    maximum = tail_scores.amax(dim=(3, 5))[:, :, :, :group]  # (n, kv, rows, group)

    if shared:
        assert shared_buffers is not None
        shared_keys, shared_values = shared_buffers
        for index, own in enumerate(layout.shared_counts):
            if own:
                shared_keys[index, :own] = keys[index][:own]
                shared_values[index, :own] = values[index][:own]
        shared_rows = max(rows * group, min_rows)
        shared_query = pad_rows(grouped.reshape(count, kv_heads, rows * group, head_dim), 2, shared_rows)
        shared_query = shared_query[:, None].expand(count, shared, kv_heads, shared_rows, head_dim)
        shared_scores = torch.bmm(
            shared_query.reshape(-1, shared_rows, head_dim),
            shared_keys.view(-1, block, head_dim).transpose(1, 2),
        ).float().view(count, shared, kv_heads, shared_rows, block)
        shared_scores = shared_scores.masked_fill(layout.shared_masked.view(count, shared, 1, 1, 1), float("-inf"))
        shared_maximum = shared_scores[:, :, :, : rows * group].amax(dim=(1, 4)).view(count, kv_heads, rows, group)
        maximum = torch.maximum(maximum, shared_maximum)

    tail_weights = torch.exp(tail_scores - pad_rows(maximum, 3, tail_rows)[:, :, :, None, :, None])
    tail_sums = torch.bmm(tail_weights.to(dtype).view(-1, tail_rows, block), tail_values.view(-1, block, head_dim))
    tail_sums = tail_sums.float().view(count, kv_heads, rows, tail, tail_rows, head_dim)[:, :, :, :, :group]
    block_sums = tail_sums.transpose(3, 4)  # (n, kv, rows, group, tail blocks, dim)
    block_totals = tail_weights.sum(-1)[:, :, :, :, :group].transpose(3, 4)  # (n, kv, rows, group, tail blocks)
    if shared:
        flat_maximum = pad_rows(maximum.reshape(count, kv_heads, rows * group), 2, shared_rows)
        shared_weights = torch.exp(shared_scores - flat_maximum[:, None, :, :, None])
        shared_sums = torch.bmm(
            shared_weights.to(dtype).view(-1, shared_rows, block), shared_values.view(-1, block, head_dim)
        ).float().view(count, shared, kv_heads, shared_rows, head_dim)[:, :, :, : rows * group]
        shared_totals = shared_weights.sum(-1)[:, :, :, : rows * group]
        shared_sums = shared_sums.view(count, shared, kv_heads, rows, group, head_dim).permute(0, 2, 3, 4, 1, 5)
        shared_totals = shared_totals.view(count, shared, kv_heads, rows, group).permute(0, 2, 3, 4, 1)
        block_sums = torch.cat([shared_sums, block_sums], 4)
        block_totals = torch.cat([shared_totals, block_totals], 4)
    total = block_sums.cumsum(4)[:, :, :, :, -1]
    weight = block_totals.cumsum(4)[:, :, :, :, -1]
    output = (total / weight[..., None]).to(dtype)  # (n, kv, rows, group, dim)
    output = output.transpose(1, 2).reshape(count * rows, kv_heads * group * head_dim)
    return output.index_select(0, layout.output_index)


@dataclass(frozen=True)
class RaggedLayout:
    """Where every row of a forward finds its keys, for the compiled kernel
    (:func:`draftwise.backend.native.ragged_attention`): its sequence's committed positions, read in place from the
    cache, then this forward's rows on its path (its ancestors, then itself), read from the new keys and values.

    Attributes:
        row_sequence: ``(rows,)`` the sequence of each flat row.
        row_committed: ``(rows,)`` its sequence's committed length.
        path_offsets: ``(rows + 1,)`` where each row's path starts in ``path_rows``.
        path_rows: flat rows of every row's path, in position order.
    """

    row_sequence: torch.Tensor
    row_committed: torch.Tensor
    path_offsets: torch.Tensor
    path_rows: torch.Tensor


def ragged_layout(lengths: Sequence[int], parents: Sequence[Sequence[int]]) -> RaggedLayout:
    """The :class:`RaggedLayout` of sequences with committed ``lengths`` and new rows with ``parents`` (see
    :mod:`draftwise.backend.rows`; a row with a negative parent follows the cache), one sequence after the other."""
    sequence_of: list[int] = []
    committed_of: list[int] = []
    offsets = [0]
    path_rows: list[int] = []
    start = 0
    for sequence, (length, own) in enumerate(zip(lengths, parents)):
        paths: list[list[int]] = []
        for row, parent in enumerate(own):
            path = [start + row] if parent < 0 else [*paths[parent], start + row]
            paths.append(path)
            path_rows.extend(path)
            offsets.append(len(path_rows))
        sequence_of.extend([sequence] * len(own))
        committed_of.extend([length] * len(own))
        start += len(own)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return RaggedLayout(as_tensor(sequence_of), as_tensor(committed_of), as_tensor(offsets), as_tensor(path_rows))
