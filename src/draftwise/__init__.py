"""draftwise: lossless draft-and-verify (speculative) decoding for transformers language models.

Quick start::

    import draftwise
    model, tokenizer = draftwise.load_model("smollm2-135m")
    result = draftwise.generate(model, tokenizer, [{"role": "user", "content": "Hi!"}], method="pld")
    print(result.text, result.stats.mean_accepted_tokens)
"""

from .api import GenerationResult, GenerationStream, encode_prompt, generate, stream
from .decoding.stats import GenerationStats
from .decoding.tree import DraftTree
from .drafters import METHODS, Drafter, StepOutcome, make_drafter
from .errors import (
    DraftwiseError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotInstalledError,
    UnknownMethodError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from .models import DEFAULT_MODEL, PRESETS, LoadOptions, load_model

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "METHODS",
    "PRESETS",
    "DraftTree",
    "Drafter",
    "DraftwiseError",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "InvalidRequestError",
    "LoadOptions",
    "ModelLoadError",
    "ModelNotInstalledError",
    "StepOutcome",
    "UnknownMethodError",
    "UnsupportedModelError",
    "UnsupportedOptionError",
    "encode_prompt",
    "generate",
    "load_model",
    "make_drafter",
    "stream",
]
