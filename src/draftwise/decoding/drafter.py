"""The drafter contract: propose a draft tree for the current context, observe how its verification went.

The engine calls :meth:`Drafter.attach` and then :meth:`Drafter.reset` when a sequence starts, :meth:`Drafter.propose` before every verification
step, :meth:`Drafter.observe` after it and :meth:`Drafter.finish` when the sequence ends. A proposal is a :class:`~draftwise.decoding.tree.DraftTree`: token nodes
below the last emitted token, optionally scored (so the engine can size the draft against its cost) and optionally
carrying the draft distributions the nodes were sampled from (model drafters: sampling then verifies by rejection
sampling, exactly). A drafter that learns from the target's hidden states sets :attr:`Drafter.wants_hidden_states`.
Model drafters (a separate draft model, the target with layers skipped) read what they need in :meth:`attach`: the
target, the sequence's KV cache, its sampling options and the engine's forward-cost model.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .sampling import SamplingParams
from .tree import DraftTree
from .verify import Verification

if TYPE_CHECKING:
    from ..backend.target import Target
    from .latency import LatencyModel


@dataclass(frozen=True)
class SequenceSetup:
    """What the engine tells a drafter about the sequence it starts (see :meth:`Drafter.attach`).

    Attributes:
        target: the model that verifies the drafts.
        cache: the target's KV cache of this sequence, holding the committed context but the last token. A drafter
            may run the target on it *after* the committed length (those slots are scratch: every verification
            forward writes its own rows there) and must leave the committed length as it found it.
        sampling: the sequence's sampling options (drafts sampled from a draft distribution use its temperature).
        latency: the engine's forward-time model, to weigh a draft's own cost against what it saves.
    """

    target: Target
    cache: Any
    sampling: SamplingParams
    latency: LatencyModel


@dataclass(frozen=True)
class StepOutcome:
    """What one verification step revealed, handed to :meth:`Drafter.observe`.

    Attributes:
        tree: the draft tree that was verified (empty when the engine drafted nothing this step).
        verification: which nodes were accepted and which tokens the walk produced.
        logits: the target's logits at every row of the forward (row 0 = root, row ``i + 1`` = node ``i``), after the
            user's sampling transforms; drafters that learn from the model read their top tokens.
        context: the sequence the tree was drafted for (prompt and output so far); it ends with the root, the token
            at row 0.
        emitted: the tokens this step appended to the sequence (the verified tokens, cut at an end of sequence or a
            stop sequence).
        hidden_states: the target's last hidden states (the output head's input) at every row, for drafters whose
            :attr:`~Drafter.wants_hidden_states` is set; ``None`` otherwise.
    """

    tree: DraftTree
    verification: Verification
    logits: torch.Tensor
    context: Sequence[int]
    emitted: Sequence[int] = ()
    hidden_states: torch.Tensor | None = None

    @property
    def root(self) -> int:
        """The token at row 0: the last token of :attr:`context`."""
        return int(self.context[-1])

    @property
    def before_root(self) -> int | None:
        """The token before the root, ``None`` at the very start."""
        return int(self.context[-2]) if len(self.context) >= 2 else None

    @property
    def new_context(self) -> tuple[int, ...]:
        """The sequence after this step: :attr:`context` followed by :attr:`emitted`."""
        return (*self.context, *self.emitted)


class Drafter(ABC):
    """Proposes draft trees. One instance serves one sequence at a time; learned state may be shared across them.

    Implementations live one per file in :mod:`draftwise.drafters` and register a method name there.
    """

    #: Method name used by ``generate(method=...)``, the CLI and the benchmark.
    name: str = ""
    #: Ask the engine for the target's hidden states in :meth:`observe` (they cost a copy per step).
    wants_hidden_states: bool = False

    def prepare(self, target: Target) -> None:
        """Called before each sequence's clock starts (its prefill, its time to first token), with the target it
        will be decoded on: a model drafter loads its draft model for ``target`` here, once, so that loading is not
        counted as decoding time (errors such as a draft model with another vocabulary are raised from here). The
        default does nothing."""

    def attach(self, setup: SequenceSetup) -> None:
        """Called for every sequence before :meth:`reset`, with the target and the sequence's cache. The default
        ignores it; model drafters bind their model here (and load it if :meth:`prepare` was not called)."""

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new sequence whose context begins with ``prompt``. Learned state that should outlive a
        request (adaptive tables) is kept."""

    @abstractmethod
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        """A draft tree of at most ``budget`` nodes continuing ``context`` (the prompt and all emitted tokens)."""

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from a verification step. The default ignores it."""

    def finish(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Called when a sequence ends (an end token, a stop sequence or its length; not when it is cancelled), with
        its prompt and everything it emitted: a drafter that learns from whole answers (earlier outputs to draft
        later requests from) takes them here. The default ignores it."""

    def fork(self) -> Drafter:
        """A drafter for another sequence decoded at the same time: it shares what this one has learned (and learns
        into the same tables) but keeps its own per-sequence state, so sequences in a batch never disturb each
        other's drafts."""
        twin = copy.copy(self)
        twin._own_sequence_state()
        return twin

    def _own_sequence_state(self) -> None:
        """Replace, in a fresh shallow copy, the attributes that hold one sequence's state (see :meth:`fork`)."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: never drafts, so every step is a one-row forward."""

    name = "ar"

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        return DraftTree()
