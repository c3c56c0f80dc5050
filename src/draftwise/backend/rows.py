"""The rows of one forward pass: which tokens are new for a sequence, where they sit and what each may attend to.

A forward extends each sequence by a *block* of new rows. Every row follows either the sequence's committed cache
(``parent == -1``) or an earlier row of the same block, so one block describes a prefill (a chain), a plain decoding
step (one row) and a draft-tree verification (the last emitted token and the draft nodes below it) alike. A row sits
at position ``committed length + depth``, where a row that follows the cache has depth 0, and it attends to the
committed cache, its ancestors in the block and itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

#: Parent of a row that follows the committed cache directly.
CACHE = -1


def row_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each row (0 for a row that follows the cache); parents must precede their children."""
    depths: list[int] = []
    for row, parent in enumerate(parents):
        if not CACHE <= parent < row:
            raise ValueError(f"row {row} has parent {parent}: parents must precede their children")
        depths.append(0 if parent == CACHE else depths[parent] + 1)
    return depths


def is_chain(parents: Sequence[int]) -> bool:
    """Whether every row follows the row before it (the first follows the cache)."""
    return all(parent == row - 1 for row, parent in enumerate(parents))


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """Boolean ``(rows, rows)`` matrix: ``m[i, j]`` when row ``j`` is row ``i`` or one of its ancestors."""
    rows = len(parents)
    if is_chain(parents):
        return np.tril(np.ones((rows, rows), dtype=bool))
    visible = np.zeros((rows, rows), dtype=bool)
    for row, parent in enumerate(parents):
        if parent != CACHE:
            visible[row] = visible[parent]
        visible[row, row] = True
    return visible


@dataclass(frozen=True)
class RowBlock:
    """The new rows of one sequence in one forward.

    Attributes:
        tokens: the token of each row.
        parents: for each row, the earlier row of the block it follows, or :data:`CACHE`.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a block needs one parent per token and at least one row")
        object.__setattr__(self, "depths", tuple(row_depths(self.parents)))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> RowBlock:
        """Rows that follow each other: a prefill, or one plain decoding step."""
        tokens = tuple(int(token) for token in tokens)
        return cls(tokens, tuple(range(CACHE, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)


def attention_mask(
    blocks: Sequence[Sequence[int]],
    lengths: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Additive 4D mask ``(batch, 1, rows, max(lengths) + rows)`` for one forward over several sequences.

    ``blocks[b]`` are the row parents of sequence ``b``, whose new rows are written at ``lengths[b]``. Row ``i`` sees
    that sequence's committed cache ``[0, lengths[b])`` and, among the new rows, its ancestors and itself. Blocks are
    padded to the same number of rows; padding rows see only the first new row so that their values stay finite.
    """
    rows = max(len(parents) for parents in blocks)
    width = max(lengths) + rows
    allowed = np.zeros((len(blocks), rows, width), dtype=bool)
    for batch_row, (parents, length) in enumerate(zip(blocks, lengths)):
        allowed[batch_row, :, :length] = True
        size = len(parents)
        allowed[batch_row, :size, length : length + size] = ancestor_matrix(parents)
        allowed[batch_row, size:, length] = True
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(dtype).min)
    return mask.unsqueeze(1).to(device)


def position_ids(blocks: Sequence[Sequence[int]], lengths: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Position of each row: the sequence's committed length plus the row's depth (padding rows: the length)."""
    rows = max(len(parents) for parents in blocks)
    positions = np.zeros((len(blocks), rows), dtype=np.int64)
    for batch_row, (parents, length) in enumerate(zip(blocks, lengths)):
        positions[batch_row] = length
        positions[batch_row, : len(parents)] += np.asarray(row_depths(parents), dtype=np.int64)
    return torch.from_numpy(positions).to(device)
