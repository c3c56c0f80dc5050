"""Models: presets and their installation (:mod:`.presets`), the options of loading one (:mod:`.options`), and
loading by the kind of weights it runs: a GGUF file's own blocks (:mod:`.file_weights`), products quantised on load
(:mod:`.requantized`), float weights from a checkpoint folder or a GGUF file converted once (:mod:`.checkpoint`);
:mod:`.targets` makes the engine's target of a loaded model and checks it on the machine, :mod:`.load` is
:func:`load_model`."""

from .checkpoint import resolve_checkpoint
from .load import eos_token_ids, load_model
from .options import BACKENDS, DTYPES, KV_CACHE_CHOICES, WEIGHTS, LoadOptions, default_device
from .presets import (
                      DEFAULT_MODEL,
                      PRESETS,
                      Preset,
                      default_cache_dir,
                      gguf_file_of,
                      install_preset,
                      is_installed,
                      preset_gguf,
)
from .targets import default_activation_bits, default_weights, make_target, release_float_matrices

__all__ = [
    "BACKENDS",
    "DEFAULT_MODEL",
    "DTYPES",
    "KV_CACHE_CHOICES",
    "PRESETS",
    "WEIGHTS",
    "LoadOptions",
    "Preset",
    "default_activation_bits",
    "default_cache_dir",
    "default_device",
    "default_weights",
    "eos_token_ids",
    "gguf_file_of",
    "install_preset",
    "is_installed",
    "load_model",
    "make_target",
    "preset_gguf",
    "release_float_matrices",
    "resolve_checkpoint",
]
