"""The decoding engine: prefill, then draft -> verify -> accept -> update, one forward pass per step.

Every method, plain autoregressive decoding (``ar``) included, runs through the :class:`Decoder`. Its state is
per sequence (:class:`SequenceState`) and its two stages, :meth:`Decoder.prefill` and :meth:`Decoder.step`, take a
list of sequences. Each stage is made of small functions that tests can drive one by one: :func:`draft` (ask the
drafter for a tree and keep the part that pays for its cost), :func:`verify` (decide what the target itself would
emit), :func:`accept` (append tokens one at a time, ending exactly where plain decoding would) and :func:`update`
(statistics, and what the drafter learns). :func:`decode` is the loop for one sequence.

The target (:class:`~draftwise.backend.target.Target`) runs the forward: the draft tree is verified in one forward
(tree attention) and the target's KV cache keeps exactly the accepted path afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backend.target import Target, as_target
from .drafter import Drafter, SequenceSetup, StepOutcome
from .latency import LatencyModel
from .sampling import Draws, SamplingParams, transform_logits
from .stats import GenerationStats
from .tree import ROOT, DraftTree
from .verify import Verification, greedy_choice, verify_greedy, verify_probabilistic, verify_sampled

#: Default upper bound on draft nodes per step. On a 2-core CPU a forward of 16 rows costs about 2x one row.
DEFAULT_BUDGET = 16


class FinishReason:
    """Why generation ended: ``"eos"``, ``"stop"`` (a stop sequence) or ``"length"`` (max_new_tokens)."""

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"


@dataclass
class StepEvent:
    """Tokens emitted by one step (after stop handling), and whether generation finished with them."""

    tokens: list[int]
    finish_reason: str | None = None


@dataclass
class SequenceState:
    """Everything the engine keeps for one sequence.

    Attributes:
        prompt_ids: the prompt's token ids.
        drafter: the sequence's drafter.
        max_new_tokens: most tokens to emit.
        sampling: the sampling options (greedy by default).
        eos: token ids that end the sequence.
        is_stopped: called with the output so far after every token; ``True`` ends the sequence (stop sequences).
        stats: counters of this sequence.
        context: the prompt and every emitted token.
        output: the emitted tokens.
        finish_reason: why the sequence ended (``None`` while it runs).
        draws: the sequence's random source (see :class:`~draftwise.decoding.sampling.Draws`).
        cache: the target's KV cache for this sequence.
        submitted: when it was queued for a batch (``time.perf_counter``; ``None`` when run directly).
        started: when its prefill began (``time.perf_counter``).
    """

    prompt_ids: tuple[int, ...]
    drafter: Drafter
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    is_stopped: Callable[[Sequence[int]], bool] | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    context: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    draws: Draws = field(default_factory=Draws)
    cache: Any = None
    submitted: float | None = None
    started: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def accept(sequence: SequenceState, tokens: Sequence[int]) -> StepEvent:
    """Append ``tokens`` one at a time, ending where plain decoding would: at the first EOS token, the first token
    after which ``is_stopped`` holds, or at ``max_new_tokens``."""
    taken: list[int] = []
    for token in tokens:
        taken.append(int(token))
        sequence.output.append(int(token))
        sequence.context.append(int(token))
        if token in sequence.eos:
            sequence.finish_reason = FinishReason.EOS
        elif sequence.is_stopped is not None and sequence.is_stopped(sequence.output):
            sequence.finish_reason = FinishReason.STOP
        elif len(sequence.output) >= sequence.max_new_tokens:
            sequence.finish_reason = FinishReason.LENGTH
        if sequence.finish_reason is not None:
            break
    return StepEvent(taken, sequence.finish_reason)


def draft(
    drafter: Drafter, context: Sequence[int], budget: int, max_depth: int, latency: LatencyModel | None = None
) -> DraftTree:
    """``drafter``'s tree for ``context``, cut to ``budget`` nodes and ``max_depth`` levels; with ``latency``, of a
    scored tree only the best nodes that pay for their verification cost are kept (see :func:`size_trees`)."""
    if max_depth <= 0 or budget <= 0:
        return DraftTree()
    tree = drafter.propose(context, budget).cut(budget, max_depth)
    return size_trees([tree], latency)[0] if latency is not None else tree


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
    node every :attr:`Decoder.EXPLORE_EVERY` steps costs one row; unscored trees are never dropped, so never
    explored."""
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
    children = [0] * (len(tree) + 1)  # by parent row: the root is row 0
    for parent in tree.parents:
        children[parent + 1] += 1
    scores: list[float] = []
    for node, parent in enumerate(tree.parents):
        depth = tree.depths[node] - 1
        attempts = stats.attempts_per_position[depth] if depth < len(stats.attempts_per_position) else 0
        accepts = stats.accepts_per_position[depth] if depth < len(stats.accepts_per_position) else 0
        base = 1.0 if parent == ROOT else scores[parent]
        scores.append(base * (accepts + 1) / (attempts + 2) / children[parent + 1])
    return DraftTree(tree.tokens, tree.parents, tuple(scores), tree.draft_probs)


def verify(
    logits: torch.Tensor,
    tree: DraftTree,
    context: Sequence[int],
    sampling: SamplingParams,
    draws: Draws | None = None,
) -> tuple[Verification, torch.Tensor]:
    """Verify ``tree`` against the target's logits at every row; returns the outcome and the transformed logits.

    The user's transforms (repetition penalty, temperature, top-k, top-p, min-p) shape the target distribution of
    every row exactly as in plain decoding. Greedy takes :func:`~draftwise.decoding.verify.greedy_choice` of each
    row; sampling draws node by node (:func:`~draftwise.decoding.verify.verify_sampled`), or by rejection sampling
    when the tree carries the draft distributions it was sampled from.
    """
    logits = transform_logits(logits, sampling, context, tree)
    if sampling.greedy:
        return verify_greedy(tree, greedy_choice(logits).tolist()), logits
    probabilities = torch.softmax(logits.float(), dim=-1)
    # Row 0 decides the token at the position right after the context.
    position = len(context)
    if tree.draft_probs is not None and len(tree):
        verification = verify_probabilistic(
            tree, probabilities, tree.draft_probs, draws, without_replacement=True, position=position
        )
        return verification, logits
    return verify_sampled(tree, probabilities, draws, position), logits


def update(
    sequence: SequenceState,
    tree: DraftTree,
    verification: Verification,
    logits: torch.Tensor,
    context: Sequence[int],
    event: StepEvent,
    hidden_states: torch.Tensor | None = None,
) -> None:
    """Count the step and let the drafter learn from it."""
    emitted = len(event.tokens)
    # An EOS or stop inside the accepted draft ends the step early: count only what was emitted.
    sequence.stats.record_step(
        emitted=emitted,
        drafted=len(tree),
        accepted=min(verification.accepted, emitted),
        attempted=min(verification.attempted, emitted),
    )
    started = time.perf_counter()
    sequence.drafter.observe(StepOutcome(tree, verification, logits, context, tuple(event.tokens), hidden_states))
    sequence.stats.draft_time_s += time.perf_counter() - started


class Decoder:
    """Runs sequences through prefill and verification steps on one target.

    Args:
        target: the model (a :class:`~draftwise.backend.target.Target`, or a transformers model to wrap in one).
        budget: most draft nodes verified per step.
        latency: forward-time model used to size drafts (learned from this decoder's forwards when not given; pass
            one in to share it between decoders on one model).
    """

    def __init__(self, target: Any, *, budget: int = DEFAULT_BUDGET, latency: LatencyModel | None = None) -> None:
        self.target: Target = as_target(target)
        # A target whose verification rows are not bitwise plain decoding's here verifies no drafts.
        self.budget = budget if self.target.exact_trees else 0
        self.latency = latency if latency is not None else LatencyModel.of(self.target)
        # By batch size: steps left without drafting, and the current pause length (see _judge_drafting).
        self._pauses: dict[int, list[int]] = {}
        # By batch size: measured tokens per second of steps with and without drafts (see _judge_by_throughput).
        self._rates: dict[int, dict[bool, tuple[float, int]]] = {}
        self._throughput_pauses: dict[int, int] = {}
        # By batch size: steps with drafts since the last one without.
        self._since_plain: dict[int, int] = {}
        # By batch size: steps since one verified a draft node (see explore).
        self._since_drafts: dict[int, int] = {}

    #: Longest pause in drafting, in steps, once drafting stopped paying at a batch size.
    MAX_DRAFT_PAUSE = 64
    #: Weight of a step in the measured rates of steps with and without drafts, and how many steps of each kind are
    #: measured before they are compared (see :meth:`_judge_by_throughput`).
    RATE_SMOOTHING = 0.2
    RATE_MIN_STEPS = 4
    #: Of several sequences, steps with drafts after which one runs without, so that the rate of plain steps at the
    #: batch size is measured and kept current: when every step drafts something, nothing else would measure it.
    PLAIN_STEP_EVERY = 32
    #: Steps without a verified draft node after which, when the cost rule drops every node on offer, the best one is
    #: verified anyway (see :func:`explore`).
    EXPLORE_EVERY = 16

    def _longer_pause(self, length: int) -> int:
        """The next pause in drafting after one of ``length`` steps: 1, 2, 4, ... up to :attr:`MAX_DRAFT_PAUSE`."""
        return min(max(1, 2 * length), self.MAX_DRAFT_PAUSE)

    def _judge_by_throughput(self, sequences: int, drafted: bool, tokens: int, seconds: float) -> None:
        """Of several sequences, pause drafting at this batch size while steps with drafts have emitted fewer tokens
        per second than steps without (moving averages of measured steps, drafting included), with the same backoff
        as :meth:`_judge_drafting`. The cost rule prices drafts from estimates; in a batch the first draft brings
        costs those see late (its rows' wider attention products, linear products past the memory-bound regime), and
        this keeps a batch from running slower than plain decoding. Where steps without drafts are rare (drafters
        that always propose something), one is run now and then to measure them (:attr:`PLAIN_STEP_EVERY`, and
        every other step until :attr:`RATE_MIN_STEPS` are measured). Batch 1 keeps the cost rule alone."""
        if sequences < 2 or seconds <= 0:
            return
        rates = self._rates.setdefault(sequences, {})
        rate = tokens / seconds
        previous, count = rates.get(drafted, (rate, 0))
        rates[drafted] = (previous + self.RATE_SMOOTHING * (rate - previous), count + 1)
        since_plain = self._since_plain[sequences] = self._since_plain.get(sequences, 0) + 1 if drafted else 0
        plain_steps = rates.get(False, (0.0, 0))[1]
        pause = self._pauses.setdefault(sequences, [0, 0])
        if drafted and (since_plain >= self.PLAIN_STEP_EVERY or plain_steps < self.RATE_MIN_STEPS):
            pause[0] = max(pause[0], 1)  # the next step at this batch size runs without drafts
        if not drafted or any(rates.get(kind, (0.0, 0))[1] < self.RATE_MIN_STEPS for kind in (True, False)):
            return
        if rates[True][0] < rates[False][0]:
            length = self._longer_pause(self._throughput_pauses.get(sequences, 0))
            self._throughput_pauses[sequences] = length
            pause[0] = max(pause[0], length)
        else:
            self._throughput_pauses[sequences] = 0

    def _judge_drafting(self, trees: Sequence[DraftTree], draft_seconds: float) -> None:
        """Pause drafting at this batch size when this step's drafts were not worth their drafting time.

        The kept nodes' expected gain, ``(sequences + sum of kept scores) / (forward time + drafting time)``, is set
        against plain steps (``sequences / forward time``). When drafting loses, drafters are not asked for the
        next few steps at this batch size (1, 2, 4, ... up to :attr:`MAX_DRAFT_PAUSE`), then tried again; at large
        batch, where the forward is dear and every sequence's drafting adds up, speculation then stops by itself.
        """
        if any(tree.scores is None for tree in trees):
            return
        sequences = len(trees)
        kept = sum(len(tree) for tree in trees)
        expected = sequences + sum(sum(tree.scores) for tree in trees)
        branching = any(not tree.is_chain for tree in trees)
        with_drafts = expected / (self.latency.cost(sequences + kept, sequences, branching) + draft_seconds)
        without = sequences / self.latency.cost(sequences, sequences)
        pause = self._pauses.setdefault(sequences, [0, 0])
        if with_drafts > without:
            pause[1] = 0
        else:
            pause[1] = self._longer_pause(pause[1])
            pause[0] = pause[1]

    def start(
        self,
        prompt_ids: Sequence[int],
        drafter: Drafter,
        *,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        is_stopped: Callable[[Sequence[int]], bool] | None = None,
        sampling: SamplingParams | None = None,
        stats: GenerationStats | None = None,
    ) -> SequenceState:
        """A new sequence, ready for :meth:`prefill` (the caller has validated the request)."""
        sampling = sampling if sampling is not None else SamplingParams()
        return SequenceState(
            prompt_ids=tuple(int(token) for token in prompt_ids),
            drafter=drafter,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos=frozenset(int(token) for token in eos_token_ids),
            is_stopped=is_stopped,
            stats=stats if stats is not None else GenerationStats(),
            context=[int(token) for token in prompt_ids],
            draws=sampling.draws(),
        )

    @torch.inference_mode()
    def prefill(self, sequences: Sequence[SequenceState]) -> list[StepEvent]:
        """Run each sequence's prompt and emit its first token (the first step of every sequence)."""
        started = time.perf_counter()
        for sequence in sequences:
            sequence.started = started
            if sequence.submitted is not None:
                sequence.stats.queue_time_s = started - sequence.submitted
            capacity = len(sequence.context) + sequence.max_new_tokens + self.budget + 1
            sequence.cache = self.target.new_cache(capacity)
        output = self.target.prefill([sequence.cache for sequence in sequences], [sequence.context for sequence in sequences])
        events = []
        for sequence, logits in zip(sequences, output.logits):
            first, _ = verify(logits[-1:], DraftTree(), sequence.context, sequence.sampling, sequence.draws)
            event = accept(sequence, first.tokens)
            now = time.perf_counter()
            sequence.stats.time_to_first_token_s = now - sequence.started
            sequence.stats.record_step(emitted=1, drafted=0, accepted=0, attempted=0)
            sequence.drafter.attach(SequenceSetup(self.target, sequence.cache, sequence.sampling, self.latency))
            sequence.drafter.reset(sequence.prompt_ids)
            sequence.stats.time_s = time.perf_counter() - sequence.started
            events.append(event)
        return events

    @torch.inference_mode()
    def step(self, sequences: Sequence[SequenceState]) -> list[StepEvent]:
        """One draft -> verify -> accept -> update step of every unfinished sequence (finished ones emit nothing)."""
        active = [sequence for sequence in sequences if not sequence.finished]
        step_started = time.perf_counter()
        limit = self.target.context_length
        trees: list[DraftTree] = []
        contexts: list[tuple[int, ...]] = []
        pause = self._pauses.setdefault(len(active), [0, 0])
        drafting = pause[0] == 0
        pause[0] = max(0, pause[0] - 1)
        draft_seconds = 0.0
        for sequence in active:
            started = time.perf_counter()
            # A draft never needs to reach past the last token we may emit or past the context window.
            max_depth = min(
                sequence.max_new_tokens - len(sequence.output) - 1, limit - len(sequence.context) - 1
            ) if drafting else 0
            # Drafters may keep what they are given: a snapshot, since the sequence's own list keeps growing.
            context = tuple(sequence.context)
            trees.append(draft(sequence.drafter, context, self.budget, max_depth))
            contexts.append(context)
            elapsed = time.perf_counter() - started
            sequence.stats.draft_time_s += elapsed
            draft_seconds += elapsed
        offered = sum(len(tree) for tree in trees)
        if len(active) > 1:  # a batch prices every draft (alone, a drafter's unscored tree is verified whole)
            trees = [scored_by_acceptance(tree, sequence.stats) for tree, sequence in zip(trees, active)]
            if self.target.batch_chains:
                trees = [tree.best_path() for tree in trees]
        offers, trees = trees, size_trees(trees, self.latency)
        since_drafts = self._since_drafts.get(len(active), 0) + 1
        exploring = offered > 0 and since_drafts >= self.EXPLORE_EVERY and not any(len(tree) for tree in trees)
        if exploring:
            trees = explore(offers)
        elif offered:  # (an empty proposal, say while a drafter is still learning, costs next to nothing)
            self._judge_drafting(trees, draft_seconds)
        drafted = any(len(tree) for tree in trees)
        self._since_drafts[len(active)] = 0 if drafted else since_drafts
        want_hidden = any(sequence.drafter.wants_hidden_states for sequence in active)
        forward_started = time.perf_counter()
        output = self.target.forward(
            [sequence.cache for sequence in active],
            [tree.rows(context[-1]) for tree, context in zip(trees, contexts)],
            hidden_states=want_hidden,
        )
        verifications = [
            verify(logits, tree, context, sequence.sampling, sequence.draws)
            for sequence, tree, context, logits in zip(active, trees, contexts, output.logits)
        ]
        self.latency.record(sum(len(tree) + 1 for tree in trees), time.perf_counter() - forward_started, len(trees),
                            tree=any(not tree.is_chain for tree in trees))
        events_by_sequence: dict[int, StepEvent] = {}
        for index, (sequence, tree, context, (verification, logits)) in enumerate(
            zip(active, trees, contexts, verifications)
        ):
            self.target.commit(sequence.cache, verification.kept_rows)
            event = accept(sequence, verification.tokens)
            hidden = output.hidden_states[index] if output.hidden_states is not None else None
            update(sequence, tree, verification, logits, context, event, hidden)
            sequence.stats.time_s = time.perf_counter() - sequence.started
            events_by_sequence[id(sequence)] = event
        if not exploring:  # (an exploring step is not expected to pay: it says nothing of drafting's rate)
            self._judge_by_throughput(len(active), drafted,
                                      sum(len(verification.tokens) for verification, _ in verifications),
                                      time.perf_counter() - step_started)
        return [events_by_sequence.get(id(sequence), StepEvent([], sequence.finish_reason)) for sequence in sequences]


def decode(
    model: Any,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    is_stopped: Callable[[Sequence[int]], bool] | None = None,
    budget: int = DEFAULT_BUDGET,
    stats: GenerationStats | None = None,
    latency: LatencyModel | None = None,
    sampling: SamplingParams | None = None,
) -> Iterator[StepEvent]:
    """Generate one sequence with ``drafter``'s drafts; yield the tokens of each step as they are accepted.

    Greedy (the default ``sampling``) gives the token ids of plain greedy decoding; sampling gives text from exactly
    the distribution of plain sampling with the same options. Emitted tokens are processed one by one and generation
    ends at the first EOS token, the first token after which ``is_stopped(output_ids)`` holds, or after
    ``max_new_tokens`` tokens, exactly where plain decoding would end. ``stats`` (if given) is filled in.

    When the drafter scores its nodes, each step verifies only the best-scoring ones that pay for their cost
    according to ``latency`` (learned from this run's forwards; pass one in to share it between runs).

    The caller validates the request (see :func:`draftwise.api.generate`); this function assumes sane arguments.
    """
    decoder = Decoder(model, budget=budget, latency=latency)
    sequence = decoder.start(
        prompt_ids,
        drafter,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        is_stopped=is_stopped,
        sampling=sampling,
        stats=stats,
    )
    [event] = decoder.prefill([sequence])
    yield event
    while not sequence.finished:
        [event] = decoder.step([sequence])
        yield event
