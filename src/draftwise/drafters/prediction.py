"""Predicted outputs (OpenAI's ``prediction`` field): the text a client expects the answer to be, drafted beside any
other drafter.

Code editing sends the file before the edit, and the answer repeats most of it. :class:`PredictionDrafter` wraps the
sequence's drafter: every step it finds where the output stands in the prediction (the output's longest suffix, up
to ``max_ngram`` tokens, that occurs in the prediction, the occurrence nearest at or after the last one used) and
offers the prediction's next tokens as a chain, merged with the wrapped drafter's tree (each path keeps its better
score). After a divergence (an edit) the next match resynchronises it, as CopySpec does. Chain nodes are scored by
the acceptance this wrapper measures per matched length and depth, so a wrong prediction soon costs nothing but the
lookup. Drafts never change the output: a wrong or hostile prediction costs speed, never tokens.

``accepted_prediction_tokens`` counts the drafted prediction tokens that were accepted; the rest of the prediction
is reported as rejected, as OpenAI's usage does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..decoding.drafter import Drafter, SequenceSetup, StepOutcome
from ..decoding.tree import DraftTree
from .stores.acceptance import AcceptanceTracker
from .stores.ngram import NGramIndex

if TYPE_CHECKING:
    from ..backend.target import Target

#: The score of an unscored node of the wrapped drafter at depth ``d`` is ``UNSCORED ** d`` once merged.
UNSCORED = 0.5


class PredictionDrafter(Drafter):
    """Draft the predicted text where the output follows it, beside ``inner``'s drafts.

    Args:
        inner: the sequence's own drafter (``ar``'s drafts nothing: the prediction alone).
        prediction: the predicted output's token ids.
        max_ngram: longest output suffix looked up in the prediction.
        max_length: most prediction tokens drafted in one step.
    """

    name = "prediction"

    def __init__(self, inner: Drafter, prediction: Sequence[int], max_ngram: int = 8, max_length: int = 64) -> None:
        if max_ngram < 1 or max_length < 1:
            raise ValueError("need max_ngram >= 1 and max_length >= 1")
        self.inner = inner
        self.prediction = tuple(int(token) for token in prediction)
        self.max_ngram = max_ngram
        self.max_length = max_length
        self.index = NGramIndex(1, max_ngram)
        self.index.extend(self.prediction)
        self.acceptance = AcceptanceTracker()
        #: Prediction tokens drafted and accepted so far.
        self.accepted_prediction_tokens = 0
        self._prompt_length = 0
        self._cursor = 0  # where in the prediction the output stood at the last match
        self._chain: tuple[int, ...] = ()
        self._kind: tuple[str, int] | None = None

    @property
    def rejected_prediction_tokens(self) -> int:
        """Prediction tokens that did not make it into the output as accepted drafts."""
        return max(0, len(self.prediction) - self.accepted_prediction_tokens)

    @property
    def wants_hidden_states(self) -> bool:  # type: ignore[override]
        return self.inner.wants_hidden_states

    def prepare(self, target: Target) -> None:
        self.inner.prepare(target)

    def attach(self, setup: SequenceSetup) -> None:
        self.inner.attach(setup)

    def reset(self, prompt: Sequence[int]) -> None:
        self.inner.reset(prompt)
        self._prompt_length = len(prompt)
        self._cursor = 0
        self._chain = ()

    def finish(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.inner.finish(prompt, output)

    def fork(self) -> PredictionDrafter:
        return PredictionDrafter(self.inner.fork(), self.prediction, self.max_ngram, self.max_length)

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        tree = self.inner.propose(context, budget)
        self._chain, self._kind = self._follow(context[self._prompt_length :])
        if not self._chain:
            return tree
        scores: dict[tuple[int, ...], float] = {}
        depths: list[tuple[int, ...]] = []
        for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            path = (*(depths[parent] if parent >= 0 else ()), token)
            depths.append(path)
            scores[path] = tree.scores[node] if tree.scores is not None else UNSCORED ** len(path)
        reach = 1.0
        for depth, rate in enumerate(self.acceptance.estimates(self._kind, len(self._chain)), start=1):
            reach *= rate
            path = self._chain[:depth]
            scores[path] = max(scores.get(path, 0.0), reach)
        return DraftTree.from_prefix_scores(scores, budget)

    def observe(self, outcome: StepOutcome) -> None:
        self.inner.observe(outcome)
        if not self._chain or not len(outcome.tree):
            return
        accepted = outcome.emitted[: outcome.verification.accepted]
        matched = 0
        while matched < min(len(accepted), len(self._chain)) and accepted[matched] == self._chain[matched]:
            matched += 1
        self.accepted_prediction_tokens += matched
        if self._kind is not None:
            self.acceptance.update(self._kind, min(len(self._chain), matched + 1), matched)

    def _follow(self, output: Sequence[int]) -> tuple[tuple[int, ...], tuple[str, int] | None]:
        """The prediction's tokens after where ``output`` stands in it, and the kind of match (``((), None)`` when
        the output's last tokens occur nowhere in the prediction)."""
        n, ends = self.index.longest(output)
        if not ends:
            return (), None
        ahead = [end for end in ends if end >= self._cursor]
        self._cursor = min(ahead) if ahead else max(ends)
        return self.prediction[self._cursor : self._cursor + self.max_length], ("match", min(n, 4))
