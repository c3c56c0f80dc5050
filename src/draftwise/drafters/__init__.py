"""Drafters, one per file, and the registry that maps method names to them.

A method is named by a spec string: ``"pld"``, or with options ``"pld:max_ngram=3,draft_length=6"``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from ..decoding.drafter import Drafter, NoDrafter, StepOutcome
from ..errors import DraftwiseError, InvalidRequestError, UnknownMethodError, UnsupportedOptionError
from .aded import AdedDrafter
from .draft_model import DraftModelDrafter
from .layer_skip import LayerSkipDrafter
from .lookahead import LookaheadDrafter
from .prompt_lookup import PromptLookupDrafter
from .rest import RestDrafter
from .suffix import SuffixDrafter
from .token_recycling import TokenRecyclingDrafter

__all__ = ["AdedDrafter", "DraftModelDrafter", "Drafter", "LayerSkipDrafter", "LookaheadDrafter", "NoDrafter", "PromptLookupDrafter", "RestDrafter", "StepOutcome", "SuffixDrafter", "TokenRecyclingDrafter", "METHODS", "check_method", "make_drafter", "parse_method", "restore_state", "save_state"]

#: Method name -> drafter factory. ``ar`` is plain autoregressive decoding through the same engine.
METHODS: dict[str, Callable[..., Drafter]] = {
    NoDrafter.name: NoDrafter,
    PromptLookupDrafter.name: PromptLookupDrafter,
    TokenRecyclingDrafter.name: TokenRecyclingDrafter,
    RestDrafter.name: RestDrafter,
    SuffixDrafter.name: SuffixDrafter,
    LookaheadDrafter.name: LookaheadDrafter,
    AdedDrafter.name: AdedDrafter,
    DraftModelDrafter.name: DraftModelDrafter,
    LayerSkipDrafter.name: LayerSkipDrafter,
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


def check_method(method: str, **options: object) -> tuple[str, dict[str, object]]:
    """The name and options of ``method`` (a name or a spec string with options), refusing an unknown method or
    option without building the drafter (a drafter may load a corpus: build it once, with :func:`make_drafter`)."""
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
    return name, options


def make_drafter(method: str, **options: object) -> Drafter:
    """Build the drafter of ``method`` (a name or a spec string with options), validating every option."""
    name, options = check_method(method, **options)
    factory = METHODS[name]
    try:
        return factory(**options)
    except (TypeError, ValueError) as error:
        raise UnsupportedOptionError(f"bad options for method {name!r}: {error}") from None


def restore_state(drafter: Drafter, path: str | os.PathLike) -> None:
    """Load a learning drafter's state from ``path`` when the file exists (a first run starts fresh); a drafter that
    keeps no state is refused."""
    if not callable(getattr(drafter, "load", None)) or not callable(getattr(drafter, "save", None)):
        raise UnsupportedOptionError(
            f"method {drafter.name!r} keeps no state; a state file applies to learning drafters (recycling, aded)"
        )
    if not os.path.exists(path):
        return
    try:
        drafter.load(path)
    except DraftwiseError:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidRequestError(f"state file {path} is not a saved state of {drafter.name} ({error})") from None


def save_state(drafter: Drafter, path: str | os.PathLike) -> None:
    """Write a learning drafter's state to ``path`` (see :func:`restore_state`)."""
    drafter.save(path)
