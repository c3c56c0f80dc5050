"""Generation statistics, with the metric definitions used everywhere in draftwise.

- step: one forward pass of the target model that emits tokens (the prefill counts as the first step).
- accepted length of a step: tokens it emitted, including the target's own bonus/correction token.
- MAT (mean accepted tokens): emitted tokens / steps (plain decoding has MAT 1.0).
- acceptance rate: accepted draft tokens / drafted tokens; per position k, the rate at which a draft token at
  depth k was accepted among steps that reached depth k with a draft on offer there.
- tokens/s: emitted tokens / generation time (first forward to last token; tokenization outside).
- queue time: seconds a batched sequence waited for a free slot before its first forward (not in generation time).
- cached prompt tokens: prompt positions restored from the prefix cache instead of prefilled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counters of one generation; derived metrics are properties."""

    new_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    queue_time_s: float = 0.0
    draft_time_s: float = 0.0
    cached_prompt_tokens: int = 0
    #: With a prediction (OpenAI's Predicted Outputs): its tokens drafted and accepted, and the rest of it.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    attempts_per_position: list[int] = field(default_factory=list)
    accepts_per_position: list[int] = field(default_factory=list)
    #: Why no drafts were verified for this sequence, where the target's verification rows are not bitwise plain
    #: decoding's on this machine (or were not checked); ``None`` where drafting was allowed.
    drafting_off: str | None = None

    def record_step(self, emitted: int, drafted: int, accepted: int, attempted: int) -> None:
        """Count one verification step that emitted ``emitted`` tokens from a draft of ``drafted`` nodes."""
        self.steps += 1
        self.new_tokens += emitted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.accepted_lengths.append(emitted)
        for position in range(attempted):
            if position == len(self.attempts_per_position):
                self.attempts_per_position.append(0)
                self.accepts_per_position.append(0)
            self.attempts_per_position[position] += 1
            if position < accepted:
                self.accepts_per_position[position] += 1

    @property
    def mean_accepted_tokens(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [accepts / attempts for accepts, attempts in zip(self.accepts_per_position, self.attempts_per_position)]

    @property
    def accepted_length_histogram(self) -> list[int]:
        """Steps by accepted length: entry ``n`` counts the steps that emitted ``n`` tokens (entry 0 is always 0)."""
        histogram = [0] * (max(self.accepted_lengths, default=0) + 1)
        for length in self.accepted_lengths:
            histogram[length] += 1
        return histogram

    @property
    def drafts(self) -> int:
        """Steps that verified a draft (steps with a draft token on offer at depth 1)."""
        return self.attempts_per_position[0] if self.attempts_per_position else 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def draft_time_share(self) -> float:
        return self.draft_time_s / self.time_s if self.time_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Counters and derived metrics as plain JSON-ready values."""
        data = asdict(self)
        data.update(
            mean_accepted_tokens=self.mean_accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            acceptance_per_position=self.acceptance_per_position,
            accepted_length_histogram=self.accepted_length_histogram,
            tokens_per_s=self.tokens_per_s,
            draft_time_share=self.draft_time_share,
        )
        return data
