"""A bounded load test against a running server: a fixed number of streaming requests from a fixed number of
concurrent clients, through the official ``openai`` client; it stops by itself.

Reports throughput (completion tokens over wall time), request latency and time to first token (p50/p99), errors,
and, when the expected answer of each prompt is given (greedy requests), how many answers differ from it: a
request that saw another's text shows up there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..bench.metrics import percentile


@dataclass
class LoadReport:
    """What a load test measured."""

    requests: int
    concurrency: int
    errors: list[str] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    wall_s: float = 0.0
    latency_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "concurrency": self.concurrency,
            "errors": len(self.errors),
            "mismatches": len(self.mismatches),
            "completion_tokens": self.completion_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "requests_per_s": round(self.requests / self.wall_s, 3) if self.wall_s > 0 else 0.0,
            "latency_p50_s": round(percentile(self.latency_s, 50), 3),
            "latency_p99_s": round(percentile(self.latency_s, 99), 3),
            "first_token_p50_s": round(percentile(self.first_token_s, 50), 3),
            "first_token_p99_s": round(percentile(self.first_token_s, 99), 3),
        }


async def run_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    requests: int,
    concurrency: int = 64,
    max_tokens: int = 32,
    expected: Sequence[str] | None = None,
    chat: bool = True,
    timeout_s: float = 600.0,
) -> LoadReport:
    """Send ``requests`` greedy streaming requests (prompt ``i % len(prompts)``), at most ``concurrency`` at once.

    Args:
        base_url: the server's ``/v1`` address.
        expected: each prompt's expected text (a greedy answer), to check that every request got its own.
        chat: chat completions (else text completions).
    """
    from openai import AsyncOpenAI

    report = LoadReport(requests=requests, concurrency=concurrency)
    gate = asyncio.Semaphore(concurrency)
    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=timeout_s, max_retries=0)

    async def one(index: int) -> None:
        prompt = prompts[index % len(prompts)]
        async with gate:
            started = time.perf_counter()
            first = None
            pieces: list[str] = []
            tokens = 0
            try:
                options: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
                if chat:
                    stream = await client.chat.completions.create(
                        messages=[{"role": "user", "content": prompt}], **options
                    )
                else:
                    stream = await client.completions.create(prompt=prompt, **options)
                async for chunk in stream:
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    piece = (choice.delta.content if chat else choice.text) or ""
                    tokens += 1
                    if first is None:
                        first = time.perf_counter() - started
                    pieces.append(piece)
            except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the test
                report.errors.append(f"request {index}: {type(error).__name__}: {error}")
                return
            report.latency_s.append(time.perf_counter() - started)
            report.first_token_s.append(first or 0.0)
            report.completion_tokens += tokens
            if expected is not None and "".join(pieces) != expected[index % len(prompts)]:
                report.mismatches.append(index)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(index) for index in range(requests)))
    finally:
        await client.close()
    report.wall_s = time.perf_counter() - started
    return report
