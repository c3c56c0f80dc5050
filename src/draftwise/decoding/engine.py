"""The decoding engine: prefill, then draft -> verify -> accept -> update, one forward pass per step.

Every method, plain autoregressive decoding (``ar``) included, runs through the :class:`Decoder`. Its state is
per sequence (:class:`SequenceState`) and its two stages, :meth:`Decoder.prefill` and :meth:`Decoder.step`, take a
list of sequences. Each stage is made of small functions that tests can drive one by one: :func:`draft` (ask the
drafter for a tree and keep the part that pays for its cost), :func:`verify` (decide what the target itself would
emit), :func:`accept` (append tokens one at a time, ending exactly where plain decoding would) and :func:`update`
(statistics, and what the drafter learns). :func:`decode` is the loop for one sequence.

The engine is mechanism only; its decisions are its :class:`~draftwise.decoding.policy.DraftingPolicy`'s: whether
to ask the drafters this step, which of their nodes pay for their verification cost (the cost rule,
:func:`~draftwise.decoding.policy.size_trees`), when to verify a dropped node anyway
(:func:`~draftwise.decoding.policy.explore`), and when to pause drafting at a batch size (drafts not worth their
drafting time, or drafted steps slower than plain ones).

The target (:class:`~draftwise.backend.target.Target`) runs the forward: the draft tree is verified in one forward
(tree attention) and the target's KV cache keeps exactly the accepted path afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backend.rows import RowBlock
from ..backend.target import Target, as_target
from ..errors import UnsupportedOptionError
from .drafter import Drafter, SequenceSetup, StepOutcome
from .latency import LatencyModel
from .logprobs import TokenLogprob, token_logprobs
from .policy import Choice, DraftingPolicy, size_trees
from .prefix_cache import PrefixCache
from .sampling import BarredEnds, Draws, SamplingParams, penalized_logits, target_probabilities
from .stats import GenerationStats
from .tree import DraftTree
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
        min_new_tokens: the sequence emits at least this many tokens before it may end (before that, ``eos`` tokens
            cannot be chosen and ``is_stopped`` is not asked; vLLM's ``min_tokens``).
        stats: counters of this sequence.
        context: the prompt and every emitted token.
        output: the emitted tokens.
        finish_reason: why the sequence ended (``None`` while it runs).
        draws: the sequence's random source (see :class:`~draftwise.decoding.sampling.Draws`).
        cache: the target's KV cache for this sequence.
        submitted: when it was queued for a batch (``time.perf_counter``; ``None`` when run directly).
        started: when its prefill began (``time.perf_counter``).
        prefilled: prompt tokens in its cache (the whole prompt once its first token is out; fewer while a
            scheduler prefills it in pieces).
        logprobs: alternatives per token to keep with each emitted token's log-probability (``None``: none kept).
        token_logprobs: each emitted token's log-probability (with ``logprobs`` set; see
            :mod:`draftwise.decoding.logprobs`).
        prompt_logprobs: the log-probability of each prompt token after the first, when asked for (``None``
            otherwise; only a prompt prefilled through :meth:`Decoder.step`'s pieces has them).
    """

    prompt_ids: tuple[int, ...]
    drafter: Drafter
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    is_stopped: Callable[[Sequence[int]], bool] | None = None
    min_new_tokens: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)
    context: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    draws: Draws = field(default_factory=Draws)
    cache: Any = None
    submitted: float | None = None
    started: float = 0.0
    prefilled: int = 0
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet in its cache."""
        return len(self.prompt_ids) - self.prefilled

    def barred_ends(self) -> BarredEnds | None:
        """The end tokens its next rows may not choose (``None`` once ``min_new_tokens`` are out)."""
        left = self.min_new_tokens - len(self.output)
        return BarredEnds(tuple(sorted(self.eos)), left) if left > 0 and self.eos else None


def accept(sequence: SequenceState, tokens: Sequence[int]) -> StepEvent:
    """Append ``tokens`` one at a time, ending where plain decoding would: at the first EOS token, the first token
    after which ``is_stopped`` holds (neither before ``min_new_tokens`` tokens), or at ``max_new_tokens``."""
    taken: list[int] = []
    for token in tokens:
        taken.append(int(token))
        sequence.output.append(int(token))
        sequence.context.append(int(token))
        may_end = len(sequence.output) >= sequence.min_new_tokens
        if token in sequence.eos and may_end:
            sequence.finish_reason = FinishReason.EOS
        elif may_end and sequence.is_stopped is not None and sequence.is_stopped(sequence.output):
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
    scored tree only the best nodes that pay for their verification cost are kept (see
    :func:`~draftwise.decoding.policy.size_trees`)."""
    if max_depth <= 0 or budget <= 0:
        return DraftTree()
    tree = drafter.propose(context, budget).cut(budget, max_depth)
    return size_trees([tree], latency)[0] if latency is not None else tree


def verify(
    logits: torch.Tensor,
    tree: DraftTree,
    context: Sequence[int],
    sampling: SamplingParams,
    draws: Draws | None = None,
    barred: BarredEnds | None = None,
    output_start: int = 0,
) -> tuple[Verification, torch.Tensor]:
    """Verify ``tree`` against the target's logits at every row; returns the outcome and the logits the drafter
    observes (after the logit bias and the penalties, the transforms that change which token is most likely, the
    presence and frequency penalties counting the output from ``output_start`` on, and with ``barred``'s end tokens
    impossible where the sequence may not end yet).

    The user's transforms (repetition penalty, temperature, top-k, top-p, min-p) shape the target distribution of
    every row exactly as in plain decoding. Greedy takes :func:`~draftwise.decoding.verify.greedy_choice` of each
    row; sampling draws node by node (:func:`~draftwise.decoding.verify.verify_sampled`), or by rejection sampling
    when the tree carries the draft distributions it was sampled from.
    """
    logits = penalized_logits(logits, sampling, context, tree, output_start)
    if barred is not None:
        logits = barred.apply(logits, tree)
    if sampling.greedy:
        return verify_greedy(tree, greedy_choice(logits).tolist()), logits
    probabilities = target_probabilities(logits, sampling)
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
        policy: decides when to draft and which drafts to verify (a :class:`~draftwise.decoding.policy.DraftingPolicy`
            over ``latency`` when not given; a given policy's latency model is the decoder's, and ``latency``, if
            given too, must be that same model).
        prefix_cache: where prompts prefilled in pieces start from cached blocks of earlier prompts and outputs, and
            where finished prompts and sequences leave theirs (:mod:`draftwise.decoding.prefix_cache`; ``None``: no
            prefix caching). The target must have :attr:`~draftwise.backend.target.Target.prefix_caching`.
    """

    def __init__(
        self,
        target: Any,
        *,
        budget: int = DEFAULT_BUDGET,
        latency: LatencyModel | None = None,
        policy: DraftingPolicy | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target: Target = as_target(target)
        if prefix_cache is not None and not self.target.prefix_caching:
            raise UnsupportedOptionError(
                "prefix caching needs a target whose prompts are prefilled as verification rows (the lean forward with "
                "its compiled kernels, rows found exact)")
        self.prefix_cache = prefix_cache
        # A target whose verification rows are not bitwise plain decoding's here verifies no drafts.
        self.budget = budget if self.target.exact_trees else 0
        if policy is not None and latency is not None and policy.latency is not latency:
            raise ValueError("the policy must price drafts with the decoder's latency model (pass one or the other)")
        if latency is None:
            latency = policy.latency if policy is not None else LatencyModel.of(self.target)
        self.latency = latency
        self.policy = policy if policy is not None else DraftingPolicy(latency)

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
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        min_new_tokens: int = 0,
    ) -> SequenceState:
        """A new sequence, ready for :meth:`prefill` (the caller has validated the request); ``min_new_tokens``: it
        emits at least this many tokens before it may end (see :class:`SequenceState`); ``logprobs``: keep
        every emitted token's log-probability with that many alternatives (and with ``prompt_logprobs``, every
        prompt token's after the first: the prompt must then be prefilled in :meth:`step`'s pieces, on a target
        with ``chunked_prefill``)."""
        sampling = sampling if sampling is not None else SamplingParams()
        return SequenceState(
            prompt_ids=tuple(int(token) for token in prompt_ids),
            drafter=drafter,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos=frozenset(int(token) for token in eos_token_ids),
            is_stopped=is_stopped,
            min_new_tokens=min_new_tokens,
            stats=stats if stats is not None else GenerationStats(),
            context=[int(token) for token in prompt_ids],
            draws=sampling.draws(),
            logprobs=logprobs,
            prompt_logprobs=[] if prompt_logprobs and logprobs is not None else None,
        )

    def open(self, sequence: SequenceState, reuse_prefix: bool = False) -> None:
        """Give a started sequence its KV cache: its prefill begins now (whole, :meth:`prefill`, or in pieces,
        :meth:`step`'s ``prompt_chunks``). Its drafter prepares first (a draft model loads), before its clock starts.
        With ``reuse_prefix`` (pieces only) the cache starts with the prefix cache's blocks of its prompt (all but
        the last token, whose row gives the first token; none where the prompt's log-probabilities are asked for)."""
        sequence.drafter.prepare(self.target)
        sequence.stats.drafting_off = self.target.drafting_off_reason
        sequence.started = time.perf_counter()
        if sequence.submitted is not None:
            sequence.stats.queue_time_s = sequence.started - sequence.submitted
        capacity = len(sequence.context) + sequence.max_new_tokens + self.budget + 1
        sequence.cache = self.target.new_cache(capacity)
        sequence.prefilled = 0
        if reuse_prefix and self.prefix_cache is not None and sequence.prompt_logprobs is None:
            sequence.prefilled = self.prefix_cache.restore(self.target, sequence.cache, sequence.prompt_ids,
                                                           len(sequence.prompt_ids) - 1)
            sequence.stats.cached_prompt_tokens = sequence.prefilled

    def remember(self, sequence: SequenceState) -> None:
        """Leave the sequence's whole blocks of prompt and output in the prefix cache (where there is one)."""
        if self.prefix_cache is not None and sequence.cache is not None:
            self.prefix_cache.store(self.target, sequence.cache, sequence.context)

    @torch.inference_mode()
    def prefill(self, sequences: Sequence[SequenceState]) -> list[StepEvent]:
        """Run each sequence's prompt and emit its first token (the first step of every sequence)."""
        if any(sequence.prompt_logprobs is not None for sequence in sequences):
            raise ValueError("prompt log-probabilities come from a prefill in pieces (Decoder.step's prompt_chunks)")
        for sequence in sequences:
            self.open(sequence)
        output = self.target.prefill([sequence.cache for sequence in sequences], [sequence.context for sequence in sequences])
        return [self._first_token(sequence, logits) for sequence, logits in zip(sequences, output.logits)]

    def _first_token(self, sequence: SequenceState, logits: torch.Tensor) -> StepEvent:
        """Its prompt is in the cache: emit the first token from the prompt's last row and set its drafter up."""
        sequence.prefilled = len(sequence.prompt_ids)
        first, _ = verify(logits[-1:], DraftTree(), sequence.context, sequence.sampling, sequence.draws,
                          sequence.barred_ends(), len(sequence.prompt_ids))
        event = accept(sequence, first.tokens)
        if sequence.logprobs is not None:
            sequence.token_logprobs += token_logprobs(logits[-1:], event.tokens, sequence.logprobs)
        sequence.stats.time_to_first_token_s = time.perf_counter() - sequence.started
        sequence.stats.record_step(emitted=1, drafted=0, accepted=0, attempted=0)
        sequence.drafter.attach(SequenceSetup(self.target, sequence.cache, sequence.sampling, self.latency))
        sequence.drafter.reset(sequence.prompt_ids)
        if sequence.finished:
            sequence.drafter.finish(sequence.prompt_ids, sequence.output)
        sequence.stats.time_s = time.perf_counter() - sequence.started
        return event

    @torch.inference_mode()
    def step(
        self, sequences: Sequence[SequenceState], prompt_chunks: Sequence[tuple[SequenceState, int]] = ()
    ) -> list[StepEvent]:
        """One draft -> verify -> accept -> update step of every unfinished sequence (finished ones emit nothing).

        The policy says whether to ask the drafters, then chooses which of their drafts to verify; the target
        verifies them in one forward, each sequence accepts its tokens and updates, and the policy hears how the
        step went.

        ``prompt_chunks`` (on a target with ``chunked_prefill``): ``(sequence, rows)`` pairs of :meth:`open`
        sequences whose next ``rows`` prompt tokens run as chains in the same forward; a sequence whose prompt is
        then whole emits its first token. Returns the events of ``sequences``, then those of ``prompt_chunks``.
        """
        if prompt_chunks and not self.target.chunked_prefill:
            raise ValueError("this target prefills whole prompts only (see Target.chunked_prefill)")
        active = [sequence for sequence in sequences if not sequence.finished]
        step_started = time.perf_counter()
        trees, contexts, choice = self._drafts(active) if active else ([], [], None)
        want_hidden = any(sequence.drafter.wants_hidden_states for sequence in active)
        chunks = [RowBlock.chain(list(sequence.prompt_ids[sequence.prefilled : sequence.prefilled + rows]))
                  for sequence, rows in prompt_chunks]
        forward_started = time.perf_counter()
        output = self.target.forward(
            [sequence.cache for sequence in active] + [sequence.cache for sequence, _ in prompt_chunks],
            [tree.rows(context[-1]) for tree, context in zip(trees, contexts)] + chunks,
            last_only=[False] * len(active) + [sequence.prompt_logprobs is None for sequence, _ in prompt_chunks],
            hidden_states=want_hidden,
        )
        forward_seconds = time.perf_counter() - forward_started
        events_by_sequence: dict[int, StepEvent] = {}
        if active:
            verifications = [
                verify(logits, tree, context, sequence.sampling, sequence.draws, sequence.barred_ends(),
                       len(sequence.prompt_ids))
                for sequence, tree, context, logits in zip(active, trees, contexts, output.logits)
            ]
            if not prompt_chunks:  # (a forward with prompt rows says nothing of what drafts cost)
                self.latency.record(sum(len(tree) + 1 for tree in trees), forward_seconds, len(trees),
                                    tree=any(not tree.is_chain for tree in trees))
            for index, (sequence, tree, context, (verification, logits)) in enumerate(
                zip(active, trees, contexts, verifications)
            ):
                self.target.commit(sequence.cache, verification.kept_rows)
                event = accept(sequence, verification.tokens)
                if sequence.logprobs is not None:  # (token i was decided by kept row i, from the raw logits)
                    rows = output.logits[index][verification.kept_rows[: len(event.tokens)]]
                    sequence.token_logprobs += token_logprobs(rows, event.tokens, sequence.logprobs)
                hidden = output.hidden_states[index] if output.hidden_states is not None else None
                update(sequence, tree, verification, logits, context, event, hidden)
                if sequence.finished:
                    self.remember(sequence)
                    sequence.drafter.finish(sequence.prompt_ids, sequence.output)
                sequence.stats.time_s = time.perf_counter() - sequence.started
                events_by_sequence[id(sequence)] = event
            # (a step that also prefilled prompt pieces says nothing of drafting's rate; an exploration in it still
            # tells whether its node was accepted)
            if choice is not None and (not prompt_chunks or choice.exploring):
                self.policy.after_step(
                    len(active),
                    choice.drafted,
                    sum(len(verification.tokens) for verification, _ in verifications),
                    time.perf_counter() - step_started,
                    exploring=choice.exploring,
                    sampling=any(not sequence.sampling.greedy for sequence in active),
                )
        chunk_events = []
        for (sequence, rows), logits in zip(prompt_chunks, output.logits[len(active):]):
            self.target.commit(sequence.cache, range(rows))
            if sequence.prompt_logprobs is not None and sequence.logprobs is not None:
                # Row i of the piece decides the prompt's token after it (the last row of the last piece: the first
                # emitted token, see _first_token).
                following = sequence.prompt_ids[sequence.prefilled + 1 : sequence.prefilled + rows + 1]
                sequence.prompt_logprobs += token_logprobs(logits, following, sequence.logprobs)
            sequence.prefilled += rows
            if not sequence.prompt_left:
                self.remember(sequence)
            chunk_events.append(self._first_token(sequence, logits) if not sequence.prompt_left else StepEvent([]))
        return [
            events_by_sequence.get(id(sequence), StepEvent([], sequence.finish_reason)) for sequence in sequences
        ] + chunk_events

    def _drafts(self, active: Sequence[SequenceState]) -> tuple[list[DraftTree], list[tuple[int, ...]], Choice]:
        """Each sequence's draft tree as the policy chooses it, the context it was drafted for, and the choice."""
        limit = self.target.context_length
        trees: list[DraftTree] = []
        contexts: list[tuple[int, ...]] = []
        drafting = self.policy.drafting(len(active))
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
        choice = self.policy.choose(
            trees,
            [sequence.stats for sequence in active],
            draft_seconds=draft_seconds,
            batch_chains=self.target.batch_chains,
            sampling=any(not sequence.sampling.greedy for sequence in active),
        )
        return choice.trees, contexts, choice


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
    min_new_tokens: int = 0,
) -> Iterator[StepEvent]:
    """Generate one sequence with ``drafter``'s drafts; yield the tokens of each step as they are accepted.

    Greedy (the default ``sampling``) gives the token ids of plain greedy decoding; sampling gives text from exactly
    the distribution of plain sampling with the same options. Emitted tokens are processed one by one and generation
    ends at the first EOS token, the first token after which ``is_stopped(output_ids)`` holds (neither before
    ``min_new_tokens`` tokens), or after ``max_new_tokens`` tokens, exactly where plain decoding would end. ``stats`` (if given) is filled in.

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
        min_new_tokens=min_new_tokens,
    )
    [event] = decoder.prefill([sequence])
    yield event
    while not sequence.finished:
        [event] = decoder.step([sequence])
        yield event
