"""Drafters, one per file, and the registry that maps method names to them.

A method is named by a spec string: ``"pld"``, or with options ``"pld:max_ngram=3,draft_length=6"``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ..errors import UnknownMethodError, UnsupportedOptionError
from .aded import AdedDrafter
from .base import Drafter, NoDrafter, StepOutcome
from .lookahead import LookaheadDrafter
from .prompt_lookup import PromptLookupDrafter
from .rest import RestDrafter
from .token_recycling import TokenRecyclingDrafter

__all__ = ["AdedDrafter", "Drafter", "LookaheadDrafter", "NoDrafter", "PromptLookupDrafter", "RestDrafter", "StepOutcome", "TokenRecyclingDrafter", "METHODS", "make_drafter", "parse_method"]

#: Method name -> drafter factory. ``ar`` is plain autoregressive decoding through the same engine.
METHODS: dict[str, Callable[..., Drafter]] = {
    NoDrafter.name: NoDrafter,
    PromptLookupDrafter.name: PromptLookupDrafter,
    TokenRecyclingDrafter.name: TokenRecyclingDrafter,
    RestDrafter.name: RestDrafter,
    LookaheadDrafter.name: LookaheadDrafter,
    AdedDrafter.name: AdedDrafter,
}


def parse_method(spec: str) -> tuple[str, dict[str, object]]:
    """Split ``"name:key=value,key=value"`` into the name and typed options (int, float, bool or str)."""
    name, _, option_text = spec.strip().partition(":")
    options: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in option_text.split(","))):
        key, separator, value = item.partition("=")
        if not separator or not key.strip():
            raise UnsupportedOptionError(f"bad method option {item!r} in {spec!r}: expected key=value")
        options[key.strip()] = _parse_value(value.strip())
    return name.strip(), options


def _parse_value(text: str) -> object:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def make_drafter(method: str, **options: object) -> Drafter:
    """Build the drafter of ``method`` (a name or a spec string with options), validating every option."""
    name, spec_options = parse_method(method)
    factory = METHODS.get(name)
    if factory is None:
        raise UnknownMethodError(f"unknown method {name!r}; available methods: {', '.join(sorted(METHODS))}")
    options = {**spec_options, **options}
    accepted = [
        parameter.name
        for parameter in inspect.signature(factory).parameters.values()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = ", ".join(accepted) if accepted else "none"
        raise UnsupportedOptionError(f"method {name!r} has no option {', '.join(unknown)}; its options: {valid}")
    try:
        return factory(**options)
    except (TypeError, ValueError) as error:
        raise UnsupportedOptionError(f"bad options for method {name!r}: {error}") from error
