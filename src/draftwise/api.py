"""Public generation API: :func:`generate` and its streaming form :func:`stream`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .backend.target import Target, as_target
from .decoding.batch import DEFAULT_MAX_BATCH, Scheduler
from .decoding.engine import DEFAULT_BUDGET, Decoder, FinishReason, SequenceState
from .decoding.latency import LatencyModel
from .decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from .decoding.sampling import SamplingParams
from .decoding.stats import GenerationStats
from .drafters import Drafter, make_drafter
from .drafters.prediction import PredictionDrafter
from .errors import InvalidRequestError, UnsupportedOptionError
from .models import eos_token_ids

Messages = Sequence[Mapping[str, Any]]

#: The method :func:`generate` and :func:`stream` decode with unless told (and ``draftwise generate``/``serve``).
DEFAULT_METHOD = "pld"
#: Tokens :func:`generate` and :func:`stream` generate at most unless told (and ``draftwise generate``).
DEFAULT_MAX_NEW_TOKENS = 128

#: The statistics of :meth:`GenerationResult.summary`, with the digits each is rounded to.
SUMMARY_DIGITS = {
    "new_tokens": 0,
    "steps": 0,
    "mean_accepted_tokens": 3,
    "drafted_tokens": 0,
    "accepted_tokens": 0,
    "acceptance_rate": 3,
    "acceptance_per_position": 3,
    "tokens_per_s": 2,
    "time_to_first_token_s": 4,
    "queue_time_s": 4,
    "time_s": 3,
    "draft_time_s": 4,
}

#: Options of :class:`~draftwise.sampling.SamplingParams` accepted as keywords by generate/stream.
SAMPLING_OPTIONS = (*(option.name for option in fields(SamplingParams)), "do_sample")


@dataclass
class GenerationResult:
    """What :func:`generate` returns.

    Attributes:
        text: the generated text (special tokens skipped, cut before a matched stop sequence).
        token_ids: the generated token ids (EOS or the token that completed a stop sequence included).
        prompt_ids: the prompt's token ids as fed to the model.
        finish_reason: ``"eos"``, ``"stop"`` or ``"length"``.
        stats: steps, MAT, acceptance, tokens/s, time to first token (see :mod:`draftwise.stats`).
        method: the decoding method used.
        logprobs: with ``logprobs=k``, each generated token's log-probability and its ``k`` most likely
            alternatives (the model's raw distribution: plain decoding's, whatever was drafted).
    """

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    method: str = ""
    logprobs: list[TokenLogprob] | None = None

    def summary(self) -> dict[str, Any]:
        """The method, why generation ended and the main statistics, rounded, as JSON-ready values (with
        ``drafting_off``: why no drafts were verified, ``None`` where drafting was allowed; with a prediction, how
        many of its tokens were accepted and rejected)."""
        stats = self.stats.to_dict()
        summary: dict[str, Any] = {"method": self.method, "finish_reason": self.finish_reason}
        for name, digits in SUMMARY_DIGITS.items():
            value = stats[name]
            summary[name] = [round(item, digits) for item in value] if isinstance(value, list) else round(value, digits)
        summary["drafting_off"] = stats["drafting_off"]
        if stats["accepted_prediction_tokens"] or stats["rejected_prediction_tokens"]:
            summary["accepted_prediction_tokens"] = stats["accepted_prediction_tokens"]
            summary["rejected_prediction_tokens"] = stats["rejected_prediction_tokens"]
        return summary


def encode_prompt(tokenizer: Any, prompt: str | Messages, chat_template: bool | None = None) -> list[int]:
    """Token ids of ``prompt``: chat messages go through the tokenizer's chat template (with the generation
    prompt); a plain string is tokenized as is, or wrapped as one user message when ``chat_template=True``."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: pass one to generate() (or token ids via prompt_ids)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidRequestError("the prompt is empty")
        if not chat_template:
            return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        prompt = [{"role": "user", "content": prompt}]
    messages = list(prompt)
    if not messages or not all(isinstance(message, Mapping) and "content" in message for message in messages):
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} mappings")
    if not any(str(message["content"]).strip() for message in messages):
        raise InvalidRequestError("the prompt is empty")
    if chat_template is False:
        raise InvalidRequestError("chat messages need the chat template; chat_template=False applies to strings only")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this tokenizer has no chat template: pass a plain string prompt instead")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]


class StopSequences:
    """Detects stop sequences in the generated text, token by token, as plain decoding would."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [text for text in stop if text]
        # A stop sequence of k characters spans at most k tokens; a few more cover partial characters.
        self.window = max((len(text) for text in self.stop), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.stop)

    def __call__(self, output_ids: Sequence[int]) -> bool:
        tail = self.tokenizer.decode(output_ids[-self.window :], skip_special_tokens=False)
        return any(text in tail for text in self.stop)

    def cut(self, text: str, keep_stop: bool = False, after: int = 0) -> str:
        """``text`` up to the first stop sequence in it that ends beyond its first ``after`` characters (the text of
        the tokens generated before stop sequences were looked for: ``min_new_tokens``), up to the stop's end with
        ``keep_stop``."""
        found = [(start, len(stop)) for stop in self.stop
                 if (start := text.find(stop, max(0, after - len(stop) + 1))) >= 0]
        if not found:
            return text
        start, size = min(found)
        return text[: start + size] if keep_stop else text[:start]

    def held_back(self, text: str) -> int:
        """How many trailing characters of ``text`` could still be the start of a stop sequence."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def unstoppable_characters(tokenizer: Any, output_ids: Sequence[int], min_new_tokens: int,
                           skip_special_tokens: bool = True) -> int:
    """How many leading characters of the output's text its first ``min_new_tokens`` tokens make: a stop sequence
    that ends within them does not end the text (they were generated before stop sequences were looked for)."""
    if min_new_tokens <= 0:
        return 0
    return len(_decode_text(tokenizer, output_ids[:min_new_tokens], skip_special_tokens))


class SettledText:
    """The text of a growing output, handed out as it settles: text that could still turn out to be the start of a
    stop sequence, or an incomplete character, is held back until the next tokens decide it; at the end the text is
    cut before a matched stop sequence. The pieces join to exactly the final text."""

    def __init__(self, tokenizer: Any, stops: StopSequences | None = None, keep_stop: bool = False,
                 skip_special_tokens: bool = True, min_new_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.keep_stop = keep_stop  # the matched stop sequence stays in the text
        self.skip_special_tokens = skip_special_tokens
        self.min_new_tokens = min_new_tokens  # (stop sequences end the text only after these tokens)
        self.sent = 0

    def advance(self, output_ids: Sequence[int], finished: bool) -> str:
        """The newly settled text of ``output_ids`` (the whole output so far); ``""`` when nothing settled."""
        text = _decode_text(self.tokenizer, output_ids, self.skip_special_tokens)
        if finished:
            if self.stops:
                text = self.stops.cut(text, self.keep_stop, unstoppable_characters(
                    self.tokenizer, output_ids, self.min_new_tokens, self.skip_special_tokens))
            ready = len(text)
        else:
            ready = len(text) - (self.stops.held_back(text) if self.stops else 0)
            if text[:ready].endswith("\ufffd"):
                ready -= 1
        if ready <= self.sent:
            return ""
        piece = text[self.sent : ready]
        self.sent = ready
        return piece


def sampling_params(options: Mapping[str, Any]) -> SamplingParams:
    """Sampling options as transformers names them; anything else is refused, never dropped.

    ``do_sample=True`` needs a temperature > 0 (1.0 if none is given), ``do_sample=False`` means greedy and refuses
    sampling options beside it.
    """
    unknown = sorted(set(options) - set(SAMPLING_OPTIONS))
    if unknown:
        raise UnsupportedOptionError(
            f"unknown option {', '.join(map(repr, unknown))}; sampling options are: {', '.join(SAMPLING_OPTIONS)}"
        )
    values = {name: value for name, value in options.items() if value is not None}
    do_sample = values.pop("do_sample", None)
    if do_sample is True:
        values.setdefault("temperature", 1.0)
        if values["temperature"] == 0:
            raise InvalidRequestError("do_sample=True needs temperature > 0")
    elif do_sample is False and values.get("temperature", 0) != 0:
        raise InvalidRequestError("do_sample=False is greedy decoding: it cannot take a temperature > 0")
    return SamplingParams(**values)


def check_request(limit: int, prompt_ids: Sequence[int], max_new_tokens: int, budget: int = 0) -> None:
    """Refuse a request the engine cannot serve exactly as asked: no prompt, no room in a context window of
    ``limit`` positions, a bad ``max_new_tokens`` or ``budget``."""
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(budget, int) or budget < 0:
        raise InvalidRequestError(f"budget must be a non-negative integer, got {budget!r}")
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    if len(prompt_ids) >= limit:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context window is {limit} tokens"
        )
    if len(prompt_ids) + max_new_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"window of {limit} tokens; lower max_new_tokens to at most {limit - len(prompt_ids)}"
        )


def check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    """Refuse a ``logit_bias`` that names a token outside the model's vocabulary."""
    outside = [token for token, _ in sampling.logit_bias if token >= vocab_size]
    if outside:
        raise InvalidRequestError(f"logit_bias names token {outside[0]}, outside the vocabulary of {vocab_size}")


def check_prediction(prediction_ids: Sequence[int], vocab_size: int) -> None:
    """Refuse a prediction that holds a token id outside the model's vocabulary."""
    if any(not 0 <= int(token) < vocab_size for token in prediction_ids):
        raise InvalidRequestError(f"prediction token ids must be in [0, {vocab_size})")


def check_min_new_tokens(min_new_tokens: int, max_new_tokens: int) -> None:
    """Refuse a ``min_new_tokens`` that is not a whole number from 0 to ``max_new_tokens`` (checked already)."""
    if (isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int)
            or not 0 <= min_new_tokens <= max_new_tokens):
        raise InvalidRequestError(f"min_new_tokens must be a whole number from 0 to max_new_tokens "
                                  f"({max_new_tokens}), got {min_new_tokens!r}")


class GenerationStream:
    """Iterator over text pieces as tokens are accepted: strings for one prompt, ``(index, piece)`` pairs for a batch
    of prompts. Once it is exhausted, :attr:`result` (one prompt) or :attr:`results` (a batch) holds what
    :func:`generate` would have returned."""

    def __init__(self, events: Iterator[Any], holder: dict[str, Any], batch: bool) -> None:
        self._events = events
        self._holder = holder
        self.batch = batch

    def __iter__(self) -> Iterator[Any]:
        return self._events

    def __next__(self) -> Any:
        return next(self._events)

    @property
    def results(self) -> list[GenerationResult]:
        if "results" not in self._holder:
            raise RuntimeError("the stream has not finished yet")
        return self._holder["results"]

    @property
    def result(self) -> GenerationResult:
        if self.batch:
            raise RuntimeError("a batch has one result per prompt: use .results")
        return self.results[0]


def stream(
    model: Any,
    tokenizer: Any,
    prompt: str | Messages | Sequence[str | Messages] | None = None,
    method: str | Drafter = DEFAULT_METHOD,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    stop: Sequence[str] | str | None = None,
    *,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    chat_template: bool | None = None,
    budget: int = DEFAULT_BUDGET,
    method_options: Mapping[str, Any] | None = None,
    latency: LatencyModel | None = None,
    sampling: SamplingParams | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    ignore_eos: bool = False,
    min_new_tokens: int = 0,
    logprobs: int | None = None,
    prediction: str | Sequence[int] | Sequence[str | Sequence[int]] | None = None,
    **options: Any,
) -> GenerationStream:
    """Like :func:`generate`, but returns an iterator of text pieces yielded as soon as tokens are accepted (for a
    batch of prompts, ``(prompt index, piece)`` pairs, in the order the pieces settle).

    Text that could still turn out to be the start of a stop sequence, or an incomplete character, is held back
    until it is settled. After the iterator is exhausted, ``.result`` (``.results`` for a batch) holds the
    :class:`GenerationResult`.
    """
    holder: dict[str, Any] = {}
    target, requests, batch = _prepare(model, tokenizer, prompt, method, max_new_tokens, stop, prompt_ids,
                                       chat_template, budget, method_options, sampling, options, ignore_eos,
                                       logprobs, min_new_tokens, prediction)

    def pieces() -> Iterator[Any]:
        texts = [SettledText(request.tokenizer, request.stops, min_new_tokens=request.min_new_tokens)
                 for request in requests]
        for index, state in _decode(target, requests, budget, latency, max_batch, holder):
            piece = texts[index].advance(state.output, state.finished)
            if piece:
                yield (index, piece) if batch else piece

    return GenerationStream(pieces(), holder, batch)


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Messages | Sequence[str | Messages] | None = None,
    method: str | Drafter = DEFAULT_METHOD,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    stop: Sequence[str] | str | None = None,
    *,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    chat_template: bool | None = None,
    budget: int = DEFAULT_BUDGET,
    method_options: Mapping[str, Any] | None = None,
    latency: LatencyModel | None = None,
    sampling: SamplingParams | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    ignore_eos: bool = False,
    min_new_tokens: int = 0,
    logprobs: int | None = None,
    prediction: str | Sequence[int] | Sequence[str | Sequence[int]] | None = None,
    **options: Any,
) -> GenerationResult | list[GenerationResult]:
    """Generate text with draft-and-verify decoding; the token ids equal those of plain greedy decoding.

    Args:
        model: the model from :func:`draftwise.load_model` (a :class:`~draftwise.backend.target.Target`), or a
            transformers causal LM (run through its public forward).
        tokenizer: its tokenizer.
        prompt: a string, or a list of chat messages (``{"role": ..., "content": ...}``) that go through the chat
            template; or a list of such prompts (a batch: one result per prompt). Alternatively pass ``prompt_ids``.
        method: ``"ar"`` (plain decoding), ``"pld"`` (prompt lookup), a spec with options such as
            ``"pld:max_ngram=3"``, or a :class:`~draftwise.drafters.Drafter` instance (a batch gives each further
            prompt a :meth:`~draftwise.drafters.Drafter.fork` of the first prompt's drafter, sharing what it learns
            and, for ``draft``, the draft model).
        max_new_tokens: most tokens to generate (per prompt).
        stop: stop sequences; generation ends at the token that completes one (the text is cut before it).
        prompt_ids: token ids to use instead of ``prompt`` (a list of lists for a batch).
        chat_template: wrap a string prompt as a user message of the chat template (default: no for strings,
            always for message lists).
        budget: most draft nodes verified per sequence and step.
        method_options: options of the method's drafter (same as the spec string's).
        latency: forward-time model used to size drafts; pass the same one to successive calls on one model to
            carry its measurements over (otherwise each call starts from the model's measured cost curve).
        sampling: the sampling options as one :class:`~draftwise.decoding.sampling.SamplingParams` (instead of
            keywords).
        max_batch: most prompts of a batch decoded at once (the rest wait and join as others finish); every
            prompt's tokens are the ones it gets decoded alone.
        ignore_eos: go on past end-of-sequence tokens up to ``max_new_tokens`` (fixed-length runs, as vLLM's
            ``ignore_eos``); stop sequences still end generation.
        min_new_tokens: generate at least this many tokens (per prompt) before an end-of-sequence token or a stop
            sequence may end generation (transformers' ``min_new_tokens``, vLLM's ``min_tokens``): until then the
            end tokens cannot be chosen, in plain decoding and in every verification row alike.
        logprobs: keep each generated token's log-probability with this many alternatives (0 to 20) in
            ``result.logprobs``: log-softmax of the raw logits in float32 (before temperature and the other sampling
            options), from the verification row that decided the token, so exactly plain decoding's.
        prediction: the text the output is expected to be (OpenAI's Predicted Outputs: the file before an edit, say),
            or its token ids; for a batch, one per prompt (``None`` entries for none). It is drafted beside the
            method's drafts wherever the output follows it (:class:`~draftwise.drafters.prediction.PredictionDrafter`);
            the output is plain decoding's whatever it says, and ``stats.accepted_prediction_tokens`` /
            ``rejected_prediction_tokens`` count how much of it was used.
        **options: sampling options with transformers' meanings: ``temperature`` (0 = greedy, the default),
            ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``seed``, ``do_sample``. Sampling output has
            exactly the distribution of plain sampling with the same options; with a fixed ``seed`` every token is
            drawn with a random number tied to its position, so a seeded request gives the same tokens with any
            method, any drafts and any batch around it, as plain sampling with that seed does. Anything else is
            refused.

    Returns:
        A :class:`GenerationResult` with the text, token ids and statistics; a list of them for a batch.

    Raises:
        InvalidRequestError: empty prompt, prompt over the context window, bad ``max_new_tokens``.
        UnknownMethodError: no such method.
        UnsupportedOptionError: an option that this mode cannot honour, or that does not exist.
    """
    holder: dict[str, Any] = {}
    target, requests, batch = _prepare(model, tokenizer, prompt, method, max_new_tokens, stop, prompt_ids,
                                       chat_template, budget, method_options, sampling, options, ignore_eos,
                                       logprobs, min_new_tokens, prediction)
    for _ in _decode(target, requests, budget, latency, max_batch, holder):
        pass
    return holder["results"] if batch else holder["results"][0]


@dataclass
class _Request:
    tokenizer: Any
    prompt_ids: list[int]
    drafter: Drafter
    method: str
    max_new_tokens: int
    stops: StopSequences | None
    eos: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None
    logprobs: int | None = None
    min_new_tokens: int = 0


def make_sampling(sampling: SamplingParams | None, options: Mapping[str, Any]) -> SamplingParams:
    """``sampling``, or the sampling options given as keywords (not both)."""
    if sampling is None:
        return sampling_params(options)
    if options:
        raise UnsupportedOptionError(
            f"give sampling options either as sampling= or as keywords, not both (got {', '.join(sorted(options))})"
        )
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    return sampling


def resolve_method(method: str | Drafter, method_options: Mapping[str, Any] | None = None) -> tuple[Drafter, str]:
    """The drafter of ``method`` (a name, a spec with options or a drafter instance) and the method's name."""
    if isinstance(method, Drafter):
        if method_options:
            raise UnsupportedOptionError("method_options apply to a method name, not to a Drafter instance")
        return method, method.name or type(method).__name__
    if isinstance(method, str):
        return make_drafter(method, **dict(method_options or {})), method
    raise InvalidRequestError(f"method must be a name or a Drafter, got {type(method).__name__}")


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(message, Mapping) for message in prompt
    )


def _batch_of(prompt: Any, prompt_ids: Any) -> tuple[list[Any], list[Any], bool]:
    """The prompts and prompt ids as equal-length lists (one of them all ``None``), and whether it is a batch."""
    if prompt_ids is not None:
        if prompt is not None:
            raise InvalidRequestError("give either prompt or prompt_ids, not both")
        ids = list(prompt_ids)
        if ids and all(isinstance(item, Sequence) and not isinstance(item, str) for item in ids):
            if not all(items for items in ids):
                raise InvalidRequestError("a batch of prompt_ids holds an empty prompt")
            return [None] * len(ids), ids, True
        return [None], [ids], False
    if prompt is None:
        raise InvalidRequestError("give a prompt (string or chat messages) or prompt_ids")
    if isinstance(prompt, str) or _is_chat(prompt):
        return [prompt], [None], False
    if isinstance(prompt, Sequence) and prompt and all(isinstance(item, str) or _is_chat(item) for item in prompt):
        return list(prompt), [None] * len(prompt), True
    raise InvalidRequestError(
        "prompt must be a string, a list of chat messages ({'role': ..., 'content': ...}), or a list of those"
    )


def _predictions(prediction: Any, count: int, batch: bool, tokenizer: Any) -> list[list[int] | None]:
    """Each prompt's prediction as token ids (``None``: no prediction)."""
    if prediction is None:
        return [None] * count
    if batch:
        if isinstance(prediction, str) or not isinstance(prediction, Sequence) or len(prediction) != count:
            raise InvalidRequestError(f"a batch of {count} prompts takes a list of {count} predictions "
                                      "(None where there is none)")
        items = list(prediction)
    else:
        items = [prediction]
    found: list[list[int] | None] = []
    for item in items:
        if item is None:
            found.append(None)
        elif isinstance(item, str):
            if tokenizer is None:
                raise InvalidRequestError("a text prediction needs a tokenizer (or give its token ids)")
            found.append(list(tokenizer(item, add_special_tokens=False)["input_ids"]) if item else None)
        elif isinstance(item, Sequence) and all(isinstance(token, int) and not isinstance(token, bool)
                                                for token in item):
            found.append([int(token) for token in item] or None)
        else:
            raise InvalidRequestError("a prediction is a string or a list of token ids")
    return found


def _prepare(model, tokenizer, prompt, method, max_new_tokens, stop, prompt_ids, chat_template, budget,
             method_options, sampling, options, ignore_eos, logprobs,
             min_new_tokens, prediction=None) -> tuple[Target, list[_Request], bool]:
    prompts, ids_list, batch = _batch_of(prompt, prompt_ids)
    predictions = _predictions(prediction, len(prompts), batch, tokenizer)
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidRequestError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {logprobs!r}")
    sampling = make_sampling(sampling, options)
    target = as_target(model)
    check_logit_bias(sampling, target.config.vocab_size)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if stops and tokenizer is None:
        raise InvalidRequestError("stop sequences need a tokenizer")
    eos = [] if ignore_eos else eos_token_ids(target.model, tokenizer)
    first_drafter, name = resolve_method(method, method_options)
    requests = []
    for index, (text, ids) in enumerate(zip(prompts, ids_list)):
        ids = encode_prompt(tokenizer, text, chat_template) if ids is None else [int(token) for token in ids]
        check_request(target.context_length, ids, max_new_tokens, budget)
        check_min_new_tokens(min_new_tokens, max_new_tokens)
        # Later prompts of a batch draft with forks: what a drafter learns, and a draft model it loads, is shared.
        drafter = first_drafter if index == 0 else first_drafter.fork()
        if predictions[index] is not None:
            check_prediction(predictions[index], target.config.vocab_size)
            drafter = PredictionDrafter(drafter, predictions[index])
        requests.append(_Request(
            tokenizer=tokenizer,
            prompt_ids=ids,
            drafter=drafter,
            method=name,
            max_new_tokens=max_new_tokens,
            stops=StopSequences(tokenizer, stops) if stops else None,
            eos=eos,
            sampling=sampling,
            logprobs=logprobs,
            min_new_tokens=min_new_tokens,
        ))
    return target, requests, batch


def _decode(
    target: Target,
    requests: Sequence[_Request],
    budget: int,
    latency: LatencyModel | None,
    max_batch: int,
    holder: dict[str, Any],
) -> Iterator[tuple[int, SequenceState]]:
    """Decode every request, up to ``max_batch`` at a time; yield ``(request index, its state)`` after each of its
    steps, and leave the results in ``holder["results"]``."""
    decoder = Decoder(target, budget=budget, latency=latency)
    scheduler = Scheduler(decoder, max_batch)
    states = [
        decoder.start(
            request.prompt_ids,
            request.drafter,
            max_new_tokens=request.max_new_tokens,
            eos_token_ids=request.eos,
            is_stopped=request.stops,
            sampling=request.sampling,
            logprobs=request.logprobs,
            min_new_tokens=request.min_new_tokens,
        )
        for request in requests
    ]
    index_of = {id(state): index for index, state in enumerate(states)}
    scheduler.submit(states)
    while not scheduler.idle:
        for state, _event in scheduler.step():
            yield index_of[id(state)], state
    holder["results"] = [_result(request, state) for request, state in zip(requests, states)]


def _result(request: _Request, state: SequenceState) -> GenerationResult:
    if isinstance(request.drafter, PredictionDrafter):
        state.stats.accepted_prediction_tokens = request.drafter.accepted_prediction_tokens
        state.stats.rejected_prediction_tokens = request.drafter.rejected_prediction_tokens
    text = _decode_text(request.tokenizer, state.output)
    if request.stops:
        text = request.stops.cut(text, after=unstoppable_characters(request.tokenizer, state.output,
                                                                    request.min_new_tokens))
    return GenerationResult(
        text=text,
        token_ids=list(state.output),
        prompt_ids=request.prompt_ids,
        finish_reason=state.finish_reason or FinishReason.LENGTH,
        stats=state.stats,
        method=request.method,
        logprobs=list(state.token_logprobs) if request.logprobs is not None else None,
    )


def _decode_text(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""
