"""An incremental index of the n-grams of a growing token sequence, shared by the drafters that copy or count."""

from __future__ import annotations

from collections.abc import Sequence


class NGramIndex:
    """Where every n-gram (``min_n <= n <= max_n``) of a token sequence occurs, kept up to date as it grows.

    An n-gram is recorded by the position right after it (where its continuation starts), and only once that
    continuation exists, so the sequence's own suffix never matches itself.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._positions: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # continuation positions < this are indexed

    def reset(self) -> None:
        self._positions.clear()
        self._indexed = 0

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams of ``tokens`` that gained a continuation since the last call."""
        if len(tokens) <= self._indexed:
            if len(tokens) < self._indexed:
                raise ValueError("the indexed sequence may only grow; call reset() for a new one")
            return
        positions = self._positions
        found = positions.get
        first, last = max(self._indexed, 1), len(tokens)
        # One n at a time, the n-grams built by zip over shifted slices (half the time of a tuple sliced per
        # n-gram); each n-gram's positions still grow in order.
        for n in range(self.min_n, self.max_n + 1):
            start = max(first, n)
            grams = zip(*(tokens[start - n + shift : last - n + shift] for shift in range(n)))
            for gram, end in zip(grams, range(start, last)):
                ends = found(gram)
                if ends is None:
                    positions[gram] = [end]
                else:
                    ends.append(end)
        self._indexed = max(last, 1)

    def continuations(self, tokens: Sequence[int], n: int) -> list[int]:
        """Positions where the last ``n`` tokens of ``tokens`` occurred earlier, most recent first."""
        if len(tokens) < n or not self.min_n <= n <= self.max_n:
            return []
        found = self._positions.get(tuple(tokens[len(tokens) - n :]))
        return found[::-1] if found else []

    def longest(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """The longest ``n`` whose last ``n`` tokens of ``tokens`` occurred earlier, with :meth:`continuations`'
        positions (most recent first); ``(0, [])`` when none did."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            ends = self.continuations(tokens, n)
            if ends:
                return n, ends
        return 0, []

    def copies(self, tokens: Sequence[int], length: int, limit: int) -> list[tuple[int, tuple[int, ...]]]:
        """Up to ``limit`` distinct continuations (``length`` tokens at most) of earlier occurrences of the last
        n-gram of ``tokens``, longest n first, most recent first; each with the ``n`` that matched.

        ``tokens`` must be the sequence this index was extended with."""
        found: list[tuple[int, tuple[int, ...]]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(self.max_n, self.min_n - 1, -1):
            for start in self.continuations(tokens, n):
                continuation = tuple(tokens[start : start + length])
                if continuation in seen:
                    continue
                seen.add(continuation)
                found.append((n, continuation))
                if len(found) >= limit:
                    return found
        return found
