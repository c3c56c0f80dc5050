"""Sampling options and the target distribution they define, identical in plain and speculative decoding.

Every option means exactly what it means in transformers (OpenAI's and vLLM's for ``logit_bias``,
``presence_penalty`` and ``frequency_penalty``, which transformers lacks), applied in the order vLLM applies them:
logit bias, repetition penalty, frequency and presence penalties, then temperature, top-k, top-p, min-p.
:func:`penalized_logits` applies the first four (the repetition penalty with transformers' own processor), each row
with the history it would have in plain decoding: the context plus the draft path down to that row; :func:`target_probabilities` then computes the distribution of every row of a verification
forward at once, the other transforms and the softmax in one pass per row on CPUs
(:func:`draftwise.backend.native.sampling_probabilities`: top-k and top-p by selection, where transformers' top-p
sorts the whole vocabulary), and with torch's operations elsewhere. :func:`transform_logits` applies transformers' processors themselves: the reference both are tested
against.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..backend import native
from ..errors import InvalidRequestError, UnsupportedOptionError
from .tree import DraftTree


class Draws:
    """Uniform random numbers for sampling, each asked for by the position of the token it decides and a stream
    (several decisions at one position). This base draws from a ``torch.Generator`` (``None``: torch's global one)
    and ignores the keys."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def uniform(self, position: int, stream: int = 0) -> float:
        """A uniform number in [0, 1)."""
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


class PositionalDraws(Draws):
    """Uniform numbers that depend only on the seed, the position and the stream (counter-based).

    Plain sampling and speculative sampling then draw the token at a position with the very same number, so for a
    given seed they emit the same tokens whatever drafts were verified, and a sequence samples the same whatever
    else shares its batch."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed

    def uniform(self, position: int, stream: int = 0) -> float:
        return random.Random(f"{self.seed}:{position}:{stream}").random()


def as_draws(source: Draws | torch.Generator | None) -> Draws:
    """``source`` as :class:`Draws` (a generator or ``None`` draws from torch)."""
    return source if isinstance(source, Draws) else Draws(source)


def sample_token(probabilities: torch.Tensor, uniform: float) -> int:
    """The token whose cumulative probability first exceeds ``uniform`` (inverse transform sampling: exactly a
    draw from ``probabilities`` for a uniform ``uniform``; tokens of probability 0 are never picked)."""
    cumulative = torch.cumsum(probabilities.double(), 0)
    index = int(torch.searchsorted(cumulative, uniform * cumulative[-1], right=True))
    return min(index, probabilities.shape[0] - 1)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options, with transformers' meanings. ``temperature=0`` (the default) is greedy decoding.

    Attributes:
        temperature: divides the logits; 0 means greedy (argmax).
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = off).
        min_p: drop tokens less likely than min_p times the most likely one (0.0 = off).
        repetition_penalty: transformers' (CTRL) penalty on tokens already in the prompt or output (1.0 = off).
        presence_penalty: subtracted from the logit of every token already in the output (OpenAI's and vLLM's
            meaning: the prompt does not count; -2 to 2, 0 = off).
        frequency_penalty: subtracted from a token's logit once per time it is already in the output (-2 to 2,
            0 = off).
        logit_bias: added to the logits of the tokens named, ``{token id: bias}`` (-100 to 100; OpenAI's meaning;
            kept as sorted pairs).
        seed: seed of the random source; the same seed gives the same output for the same method, model and options.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.greedy and (self.top_k or self.top_p < 1 or self.min_p):
            raise UnsupportedOptionError(
                "top_k, top_p and min_p shape a sampling distribution: set temperature > 0 to sample "
                "(greedy decoding with temperature=0 would silently ignore them)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reads_history(self) -> bool:
        """Whether a row's logits depend on its history (a penalty is set)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def processors(self) -> LogitsProcessorList:
        """transformers' logits processors for these options, in ``generate``'s order (transformers has none for
        ``logit_bias`` and the presence and frequency penalties)."""
        processors = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if not self.greedy:
            if self.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                processors.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                processors.append(TopPLogitsWarper(self.top_p))
            if self.min_p:
                processors.append(MinPLogitsWarper(self.min_p))
        return processors

    def draws(self) -> Draws:
        """The random source of one sequence: keyed by :attr:`seed` and position when seeded (the same token at the
        same position however verification steps fall), torch's global generator otherwise."""
        return PositionalDraws(self.seed) if self.seed is not None else Draws()

    def generator(self) -> torch.Generator:
        """A generator for a sequence's other random choices (a drafter sampling its drafts): seeded by
        :attr:`seed` when set, from fresh entropy otherwise."""
        generator = torch.Generator()
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()
        return generator


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """A ``logit_bias`` (a mapping or pairs) as sorted ``(token id, bias)`` pairs, checked."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = sorted((int(token), float(value)) for token, value in items)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    for token, value in pairs:
        if token < 0 or not -100 <= value <= 100:
            raise InvalidRequestError(f"logit_bias takes token ids >= 0 and biases from -100 to 100, got "
                                      f"{token}: {value}")
    return tuple(pairs)


def penalized_logits(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], tree: DraftTree | None = None,
    output_start: int = 0,
) -> torch.Tensor:
    """The logits of every row (row 0 = root, row i + 1 = node i) after the transforms greedy decoding applies too:
    the logit bias, the repetition penalty (the prompt and output so far), the frequency and presence penalties (the
    output alone: the history from ``output_start`` on, ``output_start`` being the prompt's length in
    ``context``); ``logits`` itself when none is set. Each row is transformed from its own history alone, so a
    verification row's logits are bitwise plain decoding's."""
    if not params.reads_history and not params.logit_bias:
        return logits
    out = logits.float().clone()
    if params.logit_bias:
        tokens = torch.tensor([token for token, _ in params.logit_bias], device=out.device)
        if int(tokens.max()) >= out.shape[-1]:
            raise InvalidRequestError(f"logit_bias names token {int(tokens.max())}, outside the vocabulary of "
                                      f"{out.shape[-1]}")
        out[:, tokens] += torch.tensor([value for _, value in params.logit_bias], device=out.device)
    if params.repetition_penalty != 1.0:
        out = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(history_ids(logits, context, tree), out)
    if params.frequency_penalty or params.presence_penalty:
        counts = output_counts(out, context, tree, output_start)
        out -= params.frequency_penalty * counts
        out -= params.presence_penalty * (counts > 0).float()
    return out


def output_counts(logits: torch.Tensor, context: Sequence[int], tree: DraftTree | None,
                  output_start: int) -> torch.Tensor:
    """How often each token occurs in every row's output so far (its history from ``output_start`` on), as a float32
    ``(rows, vocabulary)`` tensor on ``logits``' device."""
    rows, width = logits.shape
    tails = [history[output_start:] for history in row_histories(context, tree or DraftTree())[:rows]]
    longest = max((len(tail) for tail in tails), default=0)
    # (the column past the end pads short rows; only these ids travel to the logits' device, never a row of counts)
    padded = [[*tail, *([width] * (max(longest, 1) - len(tail)))] for tail in tails]
    index = torch.tensor(padded, dtype=torch.long).to(logits.device)
    counts = torch.zeros(rows, width + 1, device=logits.device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=logits.device))
    return counts[:, :width]


@dataclass(frozen=True)
class BarredEnds:
    """End tokens a sequence may not emit yet: at every row whose token would be one of the first ``min_new_tokens``
    of the output, their logits are ``-inf`` (transformers' ``min_new_tokens``, vLLM's ``min_tokens``).

    Attributes:
        tokens: the ids that would end the sequence (EOS and stop token ids).
        depth: rows of depth below it are barred (the root, row 0, has depth 0): the output tokens still to come
            before an end is allowed.
    """

    tokens: tuple[int, ...]
    depth: int

    def apply(self, logits: torch.Tensor, tree: DraftTree | None = None) -> torch.Tensor:
        """``logits`` (row 0 = root, row i + 1 = node i of ``tree``) with the barred rows' end tokens impossible."""
        depths = (0, *(tree.depths if tree is not None else ()))[: logits.shape[0]]
        rows = [row for row, depth in enumerate(depths) if depth < self.depth]
        if not rows or not self.tokens:
            return logits
        barred = logits.clone()
        index = torch.tensor(rows, device=logits.device)[:, None], torch.tensor(self.tokens, device=logits.device)
        barred[index] = float("-inf")
        return barred


def history_ids(logits: torch.Tensor, context: Sequence[int], tree: DraftTree | None) -> torch.Tensor:
    """Every row's history as a ``(rows, width)`` tensor of ids on ``logits``' device, for the repetition penalty."""
    histories = row_histories(context, tree if tree is not None else DraftTree())[: logits.shape[0]]
    width = max(len(history) for history in histories)
    # Padding repeats the last context token, which is in every history already: the penalty sees the same set.
    padded = [history + [context[-1]] * (width - len(history)) for history in histories]
    return torch.tensor(padded, dtype=torch.long, device=logits.device)


def target_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution (float32) of every row of ``logits`` (already penalized, see
    :func:`penalized_logits`): temperature, top-k, top-p and min-p with transformers' semantics, then softmax.

    Each row's distribution is computed from that row alone, so a verification row's is bitwise plain decoding's.
    """
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution (temperature is 0)")
    probabilities = native.sampling_probabilities(logits, params.temperature, params.top_k, params.top_p,
                                                  params.min_p)
    return probabilities if probabilities is not None else _probabilities_by_sorting(logits, params)


def _probabilities_by_sorting(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`target_probabilities` with torch's operations (off the CPU, or where the kernels cannot be built):
    the same rules as the kernel, the nucleus found by sorting."""
    scaled = logits.float() / params.temperature
    width = scaled.shape[-1]
    if 0 < params.top_k < width:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probabilities = torch.softmax(scaled, dim=-1)
    keep = probabilities > 0
    if params.top_p < 1.0:
        # Rank order: larger first, ties by index (the lower first, as greedy decoding breaks them).
        ranked, order = torch.sort(probabilities, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(ranked.double(), dim=-1) - ranked.double()
        in_nucleus = mass_before < params.top_p * probabilities.double().sum(-1, keepdim=True)
        keep &= torch.zeros_like(keep).scatter(-1, order, in_nucleus)
    if params.min_p > 0.0:
        keep &= probabilities >= params.min_p * probabilities.amax(dim=-1, keepdim=True)
    kept = probabilities * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def row_histories(context: Sequence[int], tree: DraftTree) -> list[list[int]]:
    """The token history of every row of a verification forward: the context, plus the path down to the row."""
    histories = [list(context)]
    for node in range(len(tree)):
        parent = tree.parents[node]
        histories.append([*histories[parent + 1], tree.tokens[node]])  # row 0 (parent ROOT) is the root
    return histories


def transform_logits(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], tree: DraftTree | None = None
) -> torch.Tensor:
    """transformers' processors for ``params`` applied to the logits of every row (row 0 = root, row i + 1 = node
    i): the reference :func:`target_probabilities` is tested against (it sorts the vocabulary for top-p)."""
    processors = params.processors()
    if not processors:
        return logits
    if params.repetition_penalty == 1.0:
        # Only the repetition penalty reads the history.
        input_ids = torch.zeros((logits.shape[0], 1), dtype=torch.long, device=logits.device)
    else:
        input_ids = history_ids(logits, context, tree)
    return processors(input_ids, logits.float().clone())
