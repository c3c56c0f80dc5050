"""The drafting policy: which drafts a step verifies, and when drafting is worth asking for at all.

The :class:`~draftwise.decoding.engine.Decoder` runs the mechanism (draft -> verify -> accept -> update); a
:class:`DraftingPolicy` makes its decisions, keeping what it has learned per batch size in a :class:`BatchState`:

* **The cost rule** (:func:`size_trees`). Every sequence's root row is verified anyway; of all scored nodes, across
  the sequences of a forward, the best ``k`` are kept with ``k`` maximising expected tokens per second,
  ``(sequences + sum of kept scores) / time(rows)`` (the expected-length-over-cost rule of Sequoia and OPT-Tree,
  with forward times from the :class:`~draftwise.decoding.latency.LatencyModel`). A large batch, whose forward
  already costs more per row, verifies fewer drafts, none once they stop paying. Unscored trees are verified whole
  when alone; in a batch they are first scored from their sequence's acceptance so far
  (:func:`scored_by_acceptance`), so they are priced like scored ones.
* **Sampling.** Drafters score nodes for agreement with the model's most likely token, which a sampled token
  shares less often. Under sampling every draft is priced by its sequence's measured acceptance
  (:func:`priced_by_acceptance`: at its own temperature, with its own drafter), alone as in a batch, and the
  throughput judging below runs at batch 1 too: drafting pays or stays off.
* **Pauses.** When a step's kept drafts were not worth their drafting time (their expected gain, drafting time
  included, below plain steps'), drafters are not asked for the next few steps at this batch size (1, 2, 4, ... up
  to :attr:`DraftingPolicy.MAX_DRAFT_PAUSE`), then tried again; at large batch, where the forward is dear and every
  sequence's drafting adds up, speculation then stops by itself.
* **Throughput judging.** Of several sequences, measured steps decide too: drafting is paused, with the same
  backoff, while steps with drafts have emitted fewer tokens per second than steps without (moving averages). The
  cost rule prices drafts from estimates; in a batch the first draft brings costs those see late (its rows' wider
  attention products, linear products past the memory-bound regime), and this keeps a batch from running slower
  than plain decoding. Where steps without drafts are rare, one is run now and then to measure them. Batch 1 keeps
  the cost rule alone, except under sampling.
* **Exploration** (:func:`explore`). Drafters learn their acceptance from verified nodes only: a source whose
  estimate fell below break-even would never be verified again, so never corrected. After
  :attr:`DraftingPolicy.EXPLORE_EVERY` steps without a verified node, when the cost rule drops every node on offer,
  the best one is verified anyway (one row). Each explored node that is rejected doubles that wait (up to
  :attr:`DraftingPolicy.MAX_EXPLORE_EVERY`): where nothing is accepted (open-ended chat for a copying drafter) an
  exploring row every 16 steps costs a few percent on a CPU whose second row is dear.

Every step run without asking the drafters is counted by the reason of its pause (:attr:`DraftingPolicy.paused_steps`,
:data:`PAUSE_REASONS`), and the measured rates of steps with and without drafts are kept per batch size: the server
exports both, so an operator sees where drafting was judged not to pay, and why.

A decoder uses the policy in three calls per step: :meth:`DraftingPolicy.drafting` (ask the drafters at all?),
:meth:`DraftingPolicy.choose` (which of their drafts to verify) and :meth:`DraftingPolicy.after_step` (how the step
went).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .latency import LatencyModel
from .stats import GenerationStats
from .tree import ROOT, DraftTree


def size_trees(trees: Sequence[DraftTree], latency: LatencyModel) -> list[DraftTree]:
    """The trees of one forward, cut to the nodes that pay for the forward's cost as a whole.

    Every sequence's root row is verified anyway; of all scored nodes, across the sequences, the best ``k`` are kept
    with ``k`` maximising expected tokens per second, ``(sequences + sum of kept scores) / time(rows)``, so a large
    batch, whose forward already costs more per row, verifies fewer drafts, none once they stop paying. Unscored
    trees are verified whole. Where a kept set branches, the forward is priced as a tree's, and the same choice over
    each tree's best path alone (priced as chains) wins when it gives more tokens per second.
    """
    sized, rate = _best_nodes(trees, latency)
    if any(tree.scores is not None and not tree.is_chain for tree in trees):
        paths, path_rate = _best_nodes([tree if tree.scores is None else tree.best_path() for tree in trees], latency)
        if path_rate > rate:
            return paths
    return sized


def least_paying_score(latency: LatencyModel, budget: int, sequences: int = 1) -> float:
    """The plain rate ``sequences / time(sequences rows)`` times the least average extra time per row of a draft
    of 1 to ``budget`` nodes, ``(time(sequences + c rows) - time(sequences rows)) / c`` (chains or trees, the lower).

    A draft whose best node scores below this never pays for its rows: ``c`` nodes add at most ``c`` times that
    score in expected tokens, less than the plain rate makes of the time they add, so :func:`size_trees` keeps none
    of them. A node scored below it beside better ones is kept only where the time estimates make its row (nearly)
    free, and then adds less than this in expected tokens a step: a drafter may leave such nodes out, and skip the
    work of drafting them.
    """
    if budget < 1:
        return 0.0
    base = latency.cost(sequences, sequences)
    least = min(
        (latency.cost(sequences + count, sequences, tree) - base) / count
        for tree in (False, True)
        for count in range(1, budget + 1)
    )
    return max(0.0, sequences / base * least)


def _best_nodes(trees: Sequence[DraftTree], latency: LatencyModel) -> tuple[list[DraftTree], float]:
    """:func:`size_trees`'s cut of ``trees`` (their best nodes across sequences) and its expected tokens per
    second."""
    rows = sum(1 + (len(tree) if tree.scores is None else 0) for tree in trees)
    branching = any(tree.scores is None and not tree.is_chain for tree in trees)
    expected = float(rows)
    ranked = sorted(
        (
            (-score, tree.depths[node], index, node)
            for index, tree in enumerate(trees)
            if tree.scores is not None
            for node, score in enumerate(tree.scores)
        )
    )
    sequences = len(trees)
    best_count, best_rate = 0, expected / latency.cost(rows, sequences, branching)
    # A parent comes before its children in this order (its score is at least theirs, and it is shallower), so the
    # first ``count`` nodes are closed under parents; they branch once two of them share a parent.
    parents_taken: set[tuple[int, int]] = set()
    for count, (negative_score, _, index, node) in enumerate(ranked, 1):
        expected -= negative_score
        parent = (index, trees[index].parents[node])
        branching = branching or parent in parents_taken
        parents_taken.add(parent)
        rate = expected / latency.cost(rows + count, sequences, branching)
        if rate > best_rate:
            best_count, best_rate = count, rate
    kept = [0] * len(trees)
    for _, _, index, _ in ranked[:best_count]:
        kept[index] += 1
    return [tree if tree.scores is None else tree.best(kept[index]) for index, tree in enumerate(trees)], best_rate


def explore(trees: Sequence[DraftTree]) -> list[DraftTree]:
    """The single best-scored node of ``trees`` (its tree cut to it, every other tree emptied), verified although
    the cost rule dropped it.

    Drafters learn their acceptance from verified nodes only: a source whose estimate fell below break-even (a few
    unlucky early prompts) would never be verified again, so never corrected, even where it would now pay. One
    node every :attr:`DraftingPolicy.EXPLORE_EVERY` steps or more (see :attr:`BatchState.explore_wait`) costs one
    row; unscored trees are never dropped, so never explored."""
    best = max(
        ((max(tree.scores), index) for index, tree in enumerate(trees) if tree.scores),
        default=None,
        key=lambda entry: (entry[0], -entry[1]),
    )
    return [tree.best(1) if best is not None and index == best[1] else DraftTree() for index, tree in enumerate(trees)]


def scored_by_acceptance(tree: DraftTree, stats: GenerationStats) -> DraftTree:
    """``tree`` with scores estimated from the sequence's acceptance so far, for drafters that give none: a node's
    score is its parent's times the rate at which drafts at its depth were accepted once reached (Laplace-smoothed),
    shared evenly among its siblings; so a batch can price such drafts against its forward's cost like scored ones."""
    if tree.scores is not None or not len(tree):
        return tree
    return DraftTree(tree.tokens, tree.parents, _acceptance_scores(tree, stats), tree.draft_probs)


def priced_by_acceptance(tree: DraftTree, stats: GenerationStats) -> DraftTree:
    """``tree`` with every score at most what the sequence's measured acceptance supports (unscored trees as in
    :func:`scored_by_acceptance`).

    Drafters score a node by how likely it is to be the model's most likely token; a sampled token agrees with it
    less often (at temperature 1 the chance is the model's probability of the draft token), so under sampling
    drafters' scores overstate acceptance. Here a scored node keeps the lower of its drafter's score and its parent's
    times the measured rate at its depth, shared among its siblings in proportion to their scores: what a sequence
    measures at its own temperature and with its own drafter prices its drafts."""
    if tree.scores is None or not len(tree):
        return scored_by_acceptance(tree, stats)
    measured = _acceptance_scores(tree, stats, shares=tree.scores)
    # (both sequences never grow along a path, so neither does their minimum)
    return DraftTree(tree.tokens, tree.parents, tuple(min(a, b) for a, b in zip(tree.scores, measured)),
                     tree.draft_probs)


def _acceptance_scores(tree: DraftTree, stats: GenerationStats, shares: Sequence[float] | None = None
                       ) -> tuple[float, ...]:
    """Each node's parent's score times the measured acceptance rate at its depth (Laplace-smoothed), split among
    siblings evenly or in proportion to ``shares``."""
    weight = [0.0] * (len(tree) + 1)  # siblings' total share, by parent row: the root is row 0
    for node, parent in enumerate(tree.parents):
        weight[parent + 1] += shares[node] if shares is not None else 1.0
    scores: list[float] = []
    for node, parent in enumerate(tree.parents):
        depth = tree.depths[node] - 1
        attempts = stats.attempts_per_position[depth] if depth < len(stats.attempts_per_position) else 0
        accepts = stats.accepts_per_position[depth] if depth < len(stats.accepts_per_position) else 0
        base = 1.0 if parent == ROOT else scores[parent]
        share = (shares[node] if shares is not None else 1.0) / weight[parent + 1] if weight[parent + 1] > 0 else 0.0
        scores.append(base * (accepts + 1) / (attempts + 2) * share)
    return tuple(scores)


#: Why a step ran without asking the drafters: the kind of pause it was in.
PAUSE_REASONS = {
    "cost": "the drafts on offer were not worth their verification and drafting time (the cost rule)",
    "throughput": "steps with drafts emitted fewer tokens per second than steps without, at this batch size",
    "measuring": "a plain step, run to keep the rate of steps without drafts measured",
}


class MeasuredRate(NamedTuple):
    """A moving average of measured tokens per second, and how many steps went into it."""

    tokens_per_second: float
    steps: int


@dataclass
class BatchState:
    """What a :class:`DraftingPolicy` keeps for one batch size (a fresh one decides as if nothing happened yet).

    Attributes:
        paused_steps_left: steps left to run without asking the drafters (0: drafting).
        pause_length: length of the last pause set because a step's drafts were not worth their drafting time (0
            once one was); the next such pause is twice as long (see :meth:`DraftingPolicy.judge_drafting`).
        rate_with_drafts: measured tokens per second of steps that verified drafts (``None`` before the first).
        rate_without_drafts: the same of steps that verified none.
        throughput_pause_length: length of the last pause set because drafted steps emitted fewer tokens per second
            than plain ones (0 once they did not; see :meth:`DraftingPolicy.after_step`).
        pause_reason: why drafting is paused (a key of :data:`PAUSE_REASONS`; ``None`` before the first pause).
        drafted_steps_since_plain: measured steps with drafts since the last one without.
        steps_since_verified_draft: steps since one verified a draft node (see :func:`explore`).
        explore_wait: steps without a verified node before the next exploration (0: the policy's
            :attr:`~DraftingPolicy.EXPLORE_EVERY`); doubled after a rejected exploration, reset by an accepted one or
            by a step that verifies drafts without exploring.
    """

    paused_steps_left: int = 0
    pause_length: int = 0
    rate_with_drafts: MeasuredRate | None = None
    rate_without_drafts: MeasuredRate | None = None
    throughput_pause_length: int = 0
    pause_reason: str | None = None
    drafted_steps_since_plain: int = 0
    steps_since_verified_draft: int = 0
    explore_wait: int = 0

    def rate(self, drafted: bool) -> MeasuredRate | None:
        """The measured rate of steps with drafts (``drafted``) or without."""
        return self.rate_with_drafts if drafted else self.rate_without_drafts

    def measured_steps(self, drafted: bool) -> int:
        """How many steps with drafts (``drafted``) or without were measured."""
        rate = self.rate(drafted)
        return rate.steps if rate is not None else 0


@dataclass
class Choice:
    """What :meth:`DraftingPolicy.choose` decided for one step.

    Attributes:
        trees: the trees to verify, one per sequence (possibly empty).
        exploring: whether they are an exploration (:func:`explore`), not expected to pay.
    """

    trees: list[DraftTree] = field(default_factory=list)
    exploring: bool = False

    @property
    def drafted(self) -> bool:
        """Whether some tree has a node to verify."""
        return any(len(tree) for tree in self.trees)


class DraftingPolicy:
    """Decides, step by step and per batch size, whether to draft and which drafts to verify (see the module
    docstring).

    Args:
        latency: the forward-time model drafts are priced with (the decoder's: it learns from its forwards).
        max_draft_pause, rate_smoothing, rate_min_steps, plain_step_every, explore_every: override the class
            attribute of the same name in upper case for this policy (``None``: keep it).

    Attributes:
        latency: the forward-time model.
        states: what is kept per batch size (see :meth:`state`).
        paused_steps: steps run without asking the drafters, by the reason of their pause (keys of
            :data:`PAUSE_REASONS`), over every batch size.
    """

    #: Longest pause in drafting, in steps, once drafting stopped paying at a batch size.
    MAX_DRAFT_PAUSE = 64
    #: Weight of a step in the measured rates of steps with and without drafts, and how many steps of each kind are
    #: measured before they are compared (see :meth:`after_step`).
    RATE_SMOOTHING = 0.2
    RATE_MIN_STEPS = 4
    #: Of several sequences, steps with drafts after which one runs without, so that the rate of plain steps at the
    #: batch size is measured and kept current: when every step drafts something, nothing else would measure it.
    PLAIN_STEP_EVERY = 32
    #: Steps without a verified draft node after which, when the cost rule drops every node on offer, the best one is
    #: verified anyway (see :func:`explore`).
    EXPLORE_EVERY = 16
    #: Longest wait between explorations, reached by doubling after each rejected one.
    MAX_EXPLORE_EVERY = 256

    def __init__(
        self,
        latency: LatencyModel,
        *,
        max_draft_pause: int | None = None,
        rate_smoothing: float | None = None,
        rate_min_steps: int | None = None,
        plain_step_every: int | None = None,
        explore_every: int | None = None,
    ) -> None:
        self.latency = latency
        self.states: dict[int, BatchState] = {}
        self.paused_steps: dict[str, int] = dict.fromkeys(PAUSE_REASONS, 0)
        if max_draft_pause is not None:
            self.MAX_DRAFT_PAUSE = max_draft_pause
        if rate_smoothing is not None:
            self.RATE_SMOOTHING = rate_smoothing
        if rate_min_steps is not None:
            self.RATE_MIN_STEPS = rate_min_steps
        if plain_step_every is not None:
            self.PLAIN_STEP_EVERY = plain_step_every
        if explore_every is not None:
            self.EXPLORE_EVERY = explore_every

    def state(self, batch_size: int) -> BatchState:
        """What is kept for ``batch_size`` sequences (created fresh on first use)."""
        state = self.states.get(batch_size)
        if state is None:
            state = self.states[batch_size] = BatchState()
        return state

    def drafting(self, batch_size: int) -> bool:
        """Whether to ask the drafters this step, at ``batch_size`` sequences; a paused step is used up."""
        state = self.state(batch_size)
        drafting = state.paused_steps_left == 0
        if not drafting:
            self.paused_steps[state.pause_reason or "cost"] += 1
        state.paused_steps_left = max(0, state.paused_steps_left - 1)
        return drafting

    def choose(
        self,
        trees: Sequence[DraftTree],
        stats: Sequence[GenerationStats],
        *,
        draft_seconds: float = 0.0,
        batch_chains: bool = False,
        sampling: bool = False,
    ) -> Choice:
        """The trees to verify of the drafters' ``trees`` (one per sequence, ``stats`` their sequences' counters),
        which took ``draft_seconds`` to draft; ``sampling``: some sequence samples.

        A batch first prices every draft (unscored trees by :func:`scored_by_acceptance`; alone, a drafter's
        unscored tree is verified whole), keeping each tree's best path where the target verifies a batch's chains
        only (``batch_chains``). Under sampling every draft, alone or in a batch, scored or not, is priced by its
        sequence's measured acceptance (:func:`priced_by_acceptance`). Then the cost rule (:func:`size_trees`)
        keeps what pays. Were nothing kept of what was offered, after :meth:`explore_wait` steps without a verified
        node the best node is explored (:func:`explore`); otherwise, if anything was offered, :meth:`judge_drafting`
        weighs the drafts against their drafting time.
        """
        batch_size = len(trees)
        offered = sum(len(tree) for tree in trees)
        state = self.state(batch_size)
        if not offered:  # (most steps of most drafters: nothing to price, explore or judge)
            state.steps_since_verified_draft += 1
            return Choice(list(trees))
        if sampling:
            trees = [priced_by_acceptance(tree, sequence_stats) for tree, sequence_stats in zip(trees, stats)]
        elif batch_size > 1:
            trees = [scored_by_acceptance(tree, sequence_stats) for tree, sequence_stats in zip(trees, stats)]
        if batch_size > 1 and batch_chains:
            trees = [tree.best_path() for tree in trees]
        offers, sized = trees, size_trees(trees, self.latency)
        since_verified = state.steps_since_verified_draft + 1
        exploring = since_verified >= self.explore_wait(state) and not any(len(tree) for tree in sized)
        if exploring:
            sized = explore(offers)
        else:
            self.judge_drafting(sized, draft_seconds)
        choice = Choice(sized, exploring)
        state.steps_since_verified_draft = 0 if choice.drafted else since_verified
        if choice.drafted and not exploring:
            state.explore_wait = 0  # (the cost rule found drafts worth their rows again)
        return choice

    def judge_drafting(self, trees: Sequence[DraftTree], draft_seconds: float) -> None:
        """Pause drafting at this batch size (``len(trees)``) when the kept ``trees`` were not worth their drafting
        time, ``draft_seconds``.

        The kept nodes' expected gain, ``(sequences + sum of kept scores) / (forward time + drafting time)``, is set
        against plain steps (``sequences / forward time``). When drafting loses, drafters are not asked for the
        next few steps at this batch size (1, 2, 4, ... up to :attr:`MAX_DRAFT_PAUSE`), then tried again. Trees
        left unscored say nothing here.
        """
        if any(tree.scores is None for tree in trees):
            return
        sequences = len(trees)
        kept = sum(len(tree) for tree in trees)
        expected = sequences + sum(sum(tree.scores) for tree in trees)
        branching = any(not tree.is_chain for tree in trees)
        with_drafts = expected / (self.latency.cost(sequences + kept, sequences, branching) + draft_seconds)
        without = sequences / self.latency.cost(sequences, sequences)
        state = self.state(sequences)
        if with_drafts > without:
            state.pause_length = 0
        else:
            state.pause_length = self._longer_pause(state.pause_length)
            state.paused_steps_left = state.pause_length
            state.pause_reason = "cost"

    def after_step(
        self, batch_size: int, drafted: bool, tokens: int, seconds: float, *, exploring: bool = False,
        sampling: bool = False,
    ) -> None:
        """Judge drafting by throughput after a step of ``batch_size`` sequences that verified drafts or not
        (``drafted``) and emitted ``tokens`` in ``seconds`` (drafting included).

        Of several sequences, drafting is paused at this batch size while steps with drafts have emitted fewer
        tokens per second than steps without (moving averages of measured steps, :attr:`RATE_MIN_STEPS` of each
        kind at least), with the same backoff as :meth:`judge_drafting`; once drafted steps keep up, the backoff
        starts over. Where steps without drafts are rare (drafters that always propose something), one is run now
        and then to measure them (every :attr:`PLAIN_STEP_EVERY` drafted steps, and after every drafted step until
        :attr:`RATE_MIN_STEPS` plain ones are measured). Batch 1 keeps the cost rule alone, except under sampling
        (``sampling``: some sequence samples), where acceptance is low and noisy enough that measured rates decide
        too; an exploring step (``exploring``) is not expected to pay: it says nothing of drafting's rate, only
        whether its node was accepted (more ``tokens`` than sequences), which sets the wait before the next.
        """
        if exploring:
            state = self.state(batch_size)
            longest = max(self.MAX_EXPLORE_EVERY, self.EXPLORE_EVERY)
            state.explore_wait = 0 if tokens > batch_size else min(2 * self.explore_wait(state), longest)
            return
        if (batch_size < 2 and not sampling) or seconds <= 0:
            return
        state = self.state(batch_size)
        rate = tokens / seconds
        measured = state.rate(drafted)
        previous, count = measured if measured is not None else (rate, 0)
        updated = MeasuredRate(previous + self.RATE_SMOOTHING * (rate - previous), count + 1)
        if drafted:
            state.rate_with_drafts = updated
        else:
            state.rate_without_drafts = updated
        state.drafted_steps_since_plain = state.drafted_steps_since_plain + 1 if drafted else 0
        if drafted and not state.paused_steps_left and (
            state.drafted_steps_since_plain >= self.PLAIN_STEP_EVERY
            or state.measured_steps(False) < self.RATE_MIN_STEPS
        ):  # the next step at this batch size runs plain
            state.paused_steps_left, state.pause_reason = 1, "measuring"
        if not drafted or any(state.measured_steps(kind) < self.RATE_MIN_STEPS for kind in (True, False)):
            return
        assert state.rate_with_drafts is not None and state.rate_without_drafts is not None
        if state.rate_with_drafts.tokens_per_second < state.rate_without_drafts.tokens_per_second:
            state.throughput_pause_length = self._longer_pause(state.throughput_pause_length)
            if state.throughput_pause_length >= state.paused_steps_left:
                state.paused_steps_left, state.pause_reason = state.throughput_pause_length, "throughput"
        else:
            state.throughput_pause_length = 0

    def explore_wait(self, state: BatchState) -> int:
        """Steps without a verified node before the next exploration at ``state``'s batch size."""
        return state.explore_wait or self.EXPLORE_EVERY

    def _longer_pause(self, length: int) -> int:
        """The next pause in drafting after one of ``length`` steps: 1, 2, 4, ... up to :attr:`MAX_DRAFT_PAUSE`."""
        return min(max(1, 2 * length), self.MAX_DRAFT_PAUSE)
