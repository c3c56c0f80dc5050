"""The drafter interface: propose a draft tree for the current context, observe how verification went."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..tree import DraftTree
from ..verify import Verification


@dataclass(frozen=True)
class StepOutcome:
    """What one verification step revealed, handed to :meth:`Drafter.observe`.

    Attributes:
        tree: the draft tree that was verified.
        verification: which nodes were accepted and which tokens were emitted.
        logits: the target's logits at every row of the forward (row 0 = root, row ``i + 1`` = node ``i``),
            after the user's sampling transforms; drafters that learn from the model read their top tokens.
        context: the full token sequence (prompt and output) after this step's tokens were appended.
        root: the token at row 0 (the last token before this step's), when the engine knows it.
        previous: the context the tree was drafted for (ending with ``root``), when the engine knows it.
    """

    tree: DraftTree
    verification: Verification
    logits: torch.Tensor
    context: Sequence[int]
    root: int | None = None
    previous: Sequence[int] = ()


class Drafter(ABC):
    """Proposes draft trees. One instance serves one sequence at a time; learned state may be shared.

    Implementations live one per file in :mod:`draftwise.drafters` and register a method name there.
    """

    #: Method name used by ``generate(method=...)``, the CLI and the benchmark.
    name: str = ""

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new sequence whose context begins with ``prompt``. Learned state that should outlive a
        request (adaptive tables) is kept."""

    @abstractmethod
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        """A draft tree of at most ``budget`` nodes continuing ``context`` (the prompt and all emitted tokens)."""

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from a verification step. The default ignores it."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: never drafts, so every step is a one-row forward."""

    name = "ar"

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        return DraftTree()
