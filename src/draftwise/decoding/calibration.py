"""Drafters' scores held to what verification finds, so that the cost rule prices drafts by their real worth.

A drafter scores each node with its estimate of the chance the node is accepted, and the engine keeps the nodes
whose summed scores pay for the rows they add (:func:`draftwise.decoding.engine.size_trees`). The estimates are the
drafter's own, learned over all its past text: where a sequence's text is harder to draft than that (Token
Recycling's scores summed to 142 expected tokens on three Spec-Bench summarization prompts, 86 were accepted), every
node looks worth more than it is, the rule verifies rows that do not pay, and the method runs slower than plain
decoding. :class:`ScoreCalibration` keeps, per sequence, how many draft tokens were accepted against how many the
verified nodes' scores promised (both decayed, so the ratio follows the text as it changes) and scales the next
trees' scores by that ratio. Which nodes are verified changes; the output never does.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tree import DraftTree


@dataclass
class ScoreCalibration:
    """Accepted draft tokens over the tokens the verified nodes' scores promised, for one sequence.

    Attributes:
        accepted: decayed count of accepted draft tokens.
        promised: decayed sum of the verified nodes' own scores.
    """

    accepted: float = 0.0
    promised: float = 0.0

    #: Promised tokens' worth of belief in the drafter's own scores before any step is seen (the ratio starts at 1).
    PRIOR = 2.0
    #: Weight kept of the past at every step: about the last fifty steps count.
    DECAY = 0.98
    #: The ratio's bounds: scores are never trusted less than this ...
    LOWEST = 0.05
    #: ... nor raised more than this (a drafter that undersells its nodes only drafts less than it could).
    HIGHEST = 1.5

    @property
    def factor(self) -> float:
        """What the drafter's scores are multiplied by (1 before any step)."""
        ratio = (self.accepted + self.PRIOR) / (self.promised + self.PRIOR)
        return min(max(ratio, self.LOWEST), self.HIGHEST)

    def scaled(self, tree: DraftTree) -> DraftTree:
        """``tree`` with its scores multiplied by :attr:`factor` (an unscored or empty tree as it is)."""
        if tree.scores is None or not len(tree):
            return tree
        factor = self.factor
        return DraftTree(tree.tokens, tree.parents, tuple(score * factor for score in tree.scores), tree.draft_probs)

    def learn(self, verified: DraftTree, factor: float, accepted: int) -> None:
        """Fold in one step: ``verified`` (scores as scaled by ``factor``) saw ``accepted`` of its nodes accepted."""
        if verified.scores is None or not len(verified):
            return
        self.accepted = self.DECAY * self.accepted + accepted
        self.promised = self.DECAY * self.promised + sum(verified.scores) / factor
