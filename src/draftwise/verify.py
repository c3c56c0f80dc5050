"""Verification: decide which draft tokens the target model itself would have produced.

These are pure functions of the draft tree and the target's choices at every row of the verification forward, so
tests can drive them directly. Greedy decoding uses :func:`greedy_choice` both in plain decoding and here: ties break
the same way (lowest token id among equal maxima) because it is literally the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tree import ROOT, DraftTree


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of ``logits`` (ties go to the lowest token id, as in ``torch.argmax``)."""
    return torch.argmax(logits, dim=-1)


@dataclass(frozen=True)
class Verification:
    """Outcome of verifying one draft tree.

    Attributes:
        accepted_nodes: node indices of the accepted path, from the root's child downwards.
        tokens: emitted tokens: the accepted draft tokens followed by the target's own next token.
        attempted: number of tree levels at which the walk met a node with children (a draft was on offer there).
    """

    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    attempted: int

    @property
    def accepted(self) -> int:
        """Number of accepted draft tokens (the bonus token not included)."""
        return len(self.accepted_nodes)

    @property
    def kept_rows(self) -> list[int]:
        """Rows of the verification forward whose keys and values stay in the cache: the root and the accepted path."""
        return [0, *(node + 1 for node in self.accepted_nodes)]


def verify_greedy(tree: DraftTree, choices: Sequence[int]) -> Verification:
    """Walk the tree from the root, descending while a child carries the target's choice.

    Args:
        tree: the draft tree that was verified.
        choices: the target's token at every row of the forward (row 0 = root, row ``i + 1`` = node ``i``).
    """
    node = ROOT
    accepted: list[int] = []
    tokens: list[int] = []
    attempted = 0
    has_children = set(tree.parents)
    while True:
        choice = int(choices[node + 1])
        tokens.append(choice)
        if node in has_children:
            attempted += 1
        child = tree.child(node, choice)
        if child is None:
            return Verification(tuple(accepted), tuple(tokens), attempted)
        accepted.append(child)
        node = child
