"""Exceptions raised by draftwise. Every user-facing failure is one of these, with a message that says what to do."""

from __future__ import annotations


class DraftwiseError(Exception):
    """Base class of all draftwise errors."""


class InvalidRequestError(DraftwiseError, ValueError):
    """A generation request is malformed: empty prompt, too long, bad option values, unknown option."""


class UnknownMethodError(InvalidRequestError):
    """The requested decoding method does not exist."""


class UnsupportedOptionError(InvalidRequestError):
    """An option was given that this mode cannot honour (it is refused, never dropped)."""


class ModelLoadError(DraftwiseError):
    """A model could not be found, installed, verified or loaded."""


class ModelNotInstalledError(ModelLoadError):
    """A preset's weight packages are not installed; the message names the command that installs them."""


class UnsupportedModelError(DraftwiseError):
    """The model's architecture cannot run through the engine (for example sliding-window or recurrent layers)."""
