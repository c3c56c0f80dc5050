"""Load tests against a running OpenAI-compatible server: a fixed number of requests from a fixed number of
concurrent clients (through the official ``openai`` client), level after level of concurrency; each level stops by
itself.

The metrics carry guidellm's names and definitions, so a run here reads like a guidellm report of the same profile:

- ``request_latency`` (seconds): from sending a request to the end of its answer;
- ``time_to_first_token_ms`` (TTFT): from sending to the first generated text (streaming only);
- ``inter_token_latency_ms`` (ITL): (last token - first token) / (output tokens - 1) (streaming only);
- ``time_per_output_token_ms`` (TPOT): (last token - start) / output tokens, the first token included;
- ``output_tokens_per_second``: output tokens of the successful requests over the level's wall time;
- ``requests_per_second``, ``request_totals`` (successful, errored, and incomplete: with ``ignore_eos``, answers
  shorter than asked, which a server cut short).

With ``turns`` above 1 (the conversation profile) each client holds a conversation: its first request is a prompt,
and each follow-up turn resends the conversation so far (the earlier prompts and answers) with one of
:data:`FOLLOW_UPS` as the next user message, as chat clients do; the follow-up turns' time to first token is
reported on its own (``follow_up_time_to_first_token_ms``, against ``first_turn_time_to_first_token_ms``): it is what
prefix caching saves. Each conversation's requests carry its ``x-session-id`` header (a Ray Serve deployment keeps
them on one replica).

Output tokens are the server's ``usage.completion_tokens`` (streams ask for the usage chunk), else the chunks with
text. Against a draftwise server each level also reads the speculation counters of ``/metrics`` before and after it:
how many sequence steps drafted, the mean acceptance length and the tokens each sequence step gave.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bench.metrics import percentile
from ..errors import InvalidRequestError
from ..files import read_text_file

#: The concurrency levels of ``draftwise loadtest --sweep`` without a list.
DEFAULT_SWEEP = (1, 4, 16)
#: The user messages of a conversation's follow-up turns (the profile's turn ``t`` sends ``FOLLOW_UPS[t - 1]``,
#: cycling): short, as a chat user's next message mostly is, so that a turn's prompt is mostly the conversation.
FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Summarize your answer in two sentences.",
    "What would you change to make it better?",
    "Give one more example.",
)


@dataclass
class RequestRecord:
    """One successful request's timings (``time.perf_counter`` seconds) and size."""

    start: float
    end: float
    output_tokens: int
    first_token: float | None = None  # None: not streamed (or no text came)
    last_token: float | None = None
    turn: int = 0  # its turn in a conversation (0: the first)
    cached_tokens: int | None = None  # prompt tokens the server reported restored from its prefix cache

    @property
    def request_latency(self) -> float:
        return self.end - self.start

    @property
    def time_to_first_token_ms(self) -> float | None:
        return None if self.first_token is None else 1000 * (self.first_token - self.start)

    @property
    def time_per_output_token_ms(self) -> float | None:
        last = self.last_token if self.last_token is not None else self.end
        return 1000 * (last - self.start) / self.output_tokens if self.output_tokens else None

    @property
    def inter_token_latency_ms(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.output_tokens <= 1:
            return None
        return 1000 * (self.last_token - self.first_token) / (self.output_tokens - 1)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """Mean, median, p95 and p99 of ``values`` (``None`` when there are none)."""
    if not values:
        return None
    return {
        "mean": round(sum(values) / len(values), 4),
        "median": round(percentile(values, 50), 4),
        "p95": round(percentile(values, 95), 4),
        "p99": round(percentile(values, 99), 4),
    }


@dataclass
class LoadReport:
    """What one level of a load test measured."""

    requests: int
    concurrency: int
    stream: bool = True
    records: list[RequestRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # fixed-length requests answered short
    mismatches: list[int] = field(default_factory=list)
    duration_s: float = 0.0
    speculation: dict[str, float] | None = None

    @property
    def output_tokens(self) -> int:
        return sum(record.output_tokens for record in self.records)

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def metrics(self) -> dict[str, Any]:
        """The level's metrics under guidellm's names (distributions: mean, median, p95, p99)."""

        def values(name: str, records: Sequence[RequestRecord] = self.records) -> list[float]:
            return [value for record in records if (value := getattr(record, name)) is not None]

        follow_ups = [record for record in self.records if record.turn]
        turns: dict[str, Any] = {}
        if follow_ups:
            cached = [record.cached_tokens for record in follow_ups if record.cached_tokens is not None]
            turns = {
                "first_turn_time_to_first_token_ms": distribution(
                    values("time_to_first_token_ms", [record for record in self.records if not record.turn])),
                "follow_up_time_to_first_token_ms": distribution(values("time_to_first_token_ms", follow_ups)),
                "follow_up_cached_prompt_tokens": round(sum(cached) / len(cached), 1) if cached else None,
            }
        return {
            "request_totals": {"successful": len(self.records), "errored": len(self.errors),
                               "incomplete": len(self.incomplete)},
            "requests_per_second": round(len(self.records) / self.duration_s, 4) if self.duration_s > 0 else 0.0,
            "output_tokens_per_second": round(self.output_tokens_per_second, 3),
            "output_token_count": self.output_tokens,
            "request_latency": distribution(values("request_latency")),
            "time_to_first_token_ms": distribution(values("time_to_first_token_ms")),
            "inter_token_latency_ms": distribution(values("inter_token_latency_ms")),
            "time_per_output_token_ms": distribution(values("time_per_output_token_ms")),
            **turns,
        }

    def summary(self) -> dict[str, Any]:
        """The level as one JSON-ready record: its settings, metrics, speculation counts and answer mismatches."""
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "stream": self.stream,
            "duration_s": round(self.duration_s, 3),
            "metrics": self.metrics(),
            "speculation": self.speculation,
            "mismatches": len(self.mismatches),
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
    *,
    stream: bool = True,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    extra_body: Mapping[str, Any] | None = None,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    turns: int = 1,
) -> LoadReport:
    """Send ``requests`` requests (prompt ``i % len(prompts)``), at most ``concurrency`` at once; with ``turns``
    above 1, ``requests`` conversations of ``turns`` requests each (see the module docstring), a client's turns one
    after the other.

    Args:
        base_url: the server's ``/v1`` address.
        expected: each prompt's expected text (a greedy answer), to check that every request got its own.
        chat: chat completions (else text completions).
        stream: streaming requests (TTFT and ITL are measured only then).
        ignore_eos: ask for exactly ``max_tokens`` tokens (vLLM's ``ignore_eos``, as guidellm sends for fixed
            output lengths).
        extra_body: more fields for every request's body (a server's own options).
        api_key: sent as ``Authorization: Bearer <api_key>`` (a server started with one).
    """
    from openai import AsyncOpenAI

    if turns < 1:
        raise InvalidRequestError(f"a conversation has at least one turn, not {turns}")
    report = LoadReport(requests=requests * turns, concurrency=concurrency, stream=stream)
    gate = asyncio.Semaphore(concurrency)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s, max_retries=0)
    options: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
    if stream:
        options["stream_options"] = {"include_usage": True}
    body = {**({"ignore_eos": True} if ignore_eos else {}), **(extra_body or {})}
    if body:
        options["extra_body"] = body

    async def request(index: int, turn: int, messages: list[dict[str, str]], prompt: str) -> str | None:
        """One request; its answer's text (``None`` when it failed or came back short)."""
        name = f"request {index}" + (f" turn {turn + 1}" if turns > 1 else "")
        start = time.perf_counter()
        first = last = None
        pieces: list[str] = []
        chunks_with_text = 0
        usage = None
        session = {"extra_headers": {"x-session-id": f"loadtest-{index}"}} if turns > 1 else {}
        try:
            if chat:
                answer = await client.chat.completions.create(messages=messages, **options, **session)
            else:
                answer = await client.completions.create(prompt=prompt, **options, **session)
            if stream:
                async for chunk in answer:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    piece = (choice.delta.content if chat else choice.text) or ""
                    if piece:
                        chunks_with_text += 1
                        last = time.perf_counter()
                        if first is None:
                            first = last
                    pieces.append(piece)
            else:
                choice = answer.choices[0]
                pieces.append((choice.message.content if chat else choice.text) or "")
                usage = answer.usage
        except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the test
            report.errors.append(f"{name}: {type(error).__name__}: {error}")
            return None
        end = time.perf_counter()
        tokens = usage.completion_tokens if usage is not None else chunks_with_text
        if ignore_eos and tokens < max_tokens:  # (a server that cut the answer short: guidellm's "incomplete")
            report.incomplete.append(f"{name}: {tokens} of {max_tokens} tokens")
            return None
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        report.records.append(RequestRecord(start, end, tokens, first, last, turn, cached))
        return "".join(pieces)

    async def one(index: int) -> None:
        prompt = prompts[index % len(prompts)]
        async with gate:
            messages = [{"role": "user", "content": prompt}]
            text: str | None = ""
            for turn in range(turns):
                if turn:
                    follow_up = FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
                    messages = [*messages, {"role": "assistant", "content": text or ""},
                                {"role": "user", "content": follow_up}]
                    prompt = f"{prompt}{text}\n\n{follow_up}\n\n"
                text = await request(index, turn, messages, prompt)
                if text is None:
                    return
                if turn == 0 and expected is not None and text != expected[index % len(prompts)]:
                    report.mismatches.append(index)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(index) for index in range(requests)))
    finally:
        await client.close()
    report.duration_s = time.perf_counter() - started
    return report


def _server_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def read_speculation_counters(base_url: str, timeout_s: float = 10.0,
                              api_key: str | None = None) -> dict[str, float] | None:
    """A draftwise server's speculation and token counters from ``/metrics`` (asked with ``api_key`` where given);
    ``None`` for other servers."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        request = urllib.request.Request(_server_root(base_url) + "/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    wanted = {
        "draftwise:spec_decode_num_drafts": "drafts",
        "draftwise:spec_decode_num_draft_tokens": "draft_tokens",
        "draftwise:spec_decode_num_accepted_tokens": "accepted_tokens",
        "draftwise:generation_tokens": "generation_tokens",
    }
    counters: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                counters[wanted[family.name]] = sum(
                    sample.value for sample in family.samples if sample.name.endswith("_total")
                )
    except ValueError:
        return None
    return counters if len(counters) == len(wanted) else None


def speculation_between(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict | None:
    """What speculation did between two readings of the counters (every request of the level finished).

    ``sequence_steps``: one per step of each sequence (generated tokens - accepted draft tokens);
    ``drafting_share``: the share of those that verified a draft; ``mean_acceptance_length``: 1 + accepted /
    drafts (vLLM's definition); ``tokens_per_sequence_step``: what each step of a sequence gave.
    """
    if before is None or after is None:
        return None
    delta = {name: after[name] - before[name] for name in after}
    steps = delta["generation_tokens"] - delta["accepted_tokens"]
    if steps <= 0:
        return None
    drafts = delta["drafts"]
    return {
        "sequence_steps": int(steps),
        "drafting_share": round(drafts / steps, 4),
        "draft_tokens": int(delta["draft_tokens"]),
        "accepted_tokens": int(delta["accepted_tokens"]),
        "acceptance_rate": round(delta["accepted_tokens"] / delta["draft_tokens"], 4) if delta["draft_tokens"] else 0.0,
        "mean_acceptance_length": round(1 + delta["accepted_tokens"] / drafts, 4) if drafts else 1.0,
        "tokens_per_sequence_step": round(delta["generation_tokens"] / steps, 4),
    }


#: Requests per concurrent client in a level when no count is given (guidellm's usual profile: 8 at 1, 64 at 16).
DEFAULT_REQUESTS_PER_CLIENT = 4


def requests_for(concurrency: int, per_client: int = DEFAULT_REQUESTS_PER_CLIENT) -> int:
    """Requests of a level when none are given: ``per_client`` per client, at least twice that many."""
    return per_client * max(2, concurrency)


def sweep(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    concurrencies: Sequence[int],
    max_tokens: int,
    requests: int | None = None,
    per_client: int = DEFAULT_REQUESTS_PER_CLIENT,
    warmup: int = 1,
    on_level: Callable[[LoadReport], None] | None = None,
    **options: Any,
) -> list[LoadReport]:
    """One level of :func:`run_load` per concurrency, one after the other (``requests`` each, or ``per_client`` per
    concurrent client), after ``warmup`` unmeasured requests; speculation counters are read around each level."""
    if warmup:
        asyncio.run(run_load(base_url, model, prompts, warmup, 1, max_tokens, **options))
    reports = []
    for concurrency in concurrencies:
        api_key = options.get("api_key")
        before = read_speculation_counters(base_url, api_key=api_key)
        count = requests if requests is not None else requests_for(concurrency, per_client)
        report = asyncio.run(run_load(base_url, model, prompts, count, concurrency, max_tokens, **options))
        report.speculation = speculation_between(before, read_speculation_counters(base_url, api_key=api_key))
        reports.append(report)
        if on_level is not None:
            on_level(report)
    return reports


def synthetic_prompts(tokenizer: Any, texts: Sequence[str], count: int, prompt_tokens: int) -> list[str]:
    """``count`` prompts of about ``prompt_tokens`` tokens each: distinct windows of the token stream of ``texts``
    (real text, as guidellm's synthetic data cuts a corpus), decoded back to text."""
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
    if not stream:
        raise ValueError("no text to cut prompts from")
    while len(stream) < prompt_tokens + count:
        stream = stream + stream
    stride = max(1, (len(stream) - prompt_tokens) // count)
    return [tokenizer.decode(stream[index * stride : index * stride + prompt_tokens]) for index in range(count)]


def write_results(path: str | Path, label: str, settings: Mapping[str, Any], reports: Sequence[LoadReport]) -> Path:
    """The run as JSON: its label, settings and one record per level (``draftwise loadtest --compare`` reads it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"label": label, "settings": dict(settings),
                                "levels": [report.summary() for report in reports]}, indent=1))
    return path


def read_results(path: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """The label and levels of a results file written by :func:`write_results` (one that is not raises
    :class:`~draftwise.errors.InvalidRequestError` naming it)."""
    try:
        data = json.loads(read_text_file(path, "loadtest results file"))
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"loadtest results file {path} is not JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("levels"), list):
        raise InvalidRequestError(f"loadtest results file {path} is not one written by draftwise loadtest --json")
    return str(data.get("label") or Path(path).stem), list(data["levels"])
