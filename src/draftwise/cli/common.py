"""What the commands share: the model flags (one :class:`~draftwise.models.LoadOptions` built from them), the
sampling flags, loading with a line saying what loaded, and reading text files a user names."""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from ..backend.weights.quantized import ACTIVATION_BITS
from ..decoding.sampling import SamplingParams
from ..errors import InvalidRequestError
from ..models import (
    BACKENDS,
    DEFAULT_MODEL,
    DTYPES,
    KV_CACHE_CHOICES,
    WEIGHTS,
    LoadOptions,
    default_cache_dir,
    load_model,
)

#: The library's defaults, which the flags take as theirs.
LOAD_DEFAULTS = LoadOptions()
SAMPLING_DEFAULTS = SamplingParams()


def add_model_arguments(parser: argparse.ArgumentParser, several_dtypes: bool = False) -> None:
    """The flags of every command that loads a model: one per :class:`~draftwise.models.LoadOptions` field, and
    ``--model`` and ``--threads`` (``several_dtypes``: ``--dtype`` takes a comma-separated list)."""
    defaults = LOAD_DEFAULTS
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"preset, GGUF file or checkpoint folder (default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default=defaults.dtype, choices=None if several_dtypes else DTYPES,
                        help=("comma-separated, each " if several_dtypes else "") + "auto (bfloat16 on a GPU or a CPU "
                        "with native bf16, float32 beside quantised weights or otherwise), float32, bfloat16, float16")
    parser.add_argument("--backend", default=defaults.backend, choices=BACKENDS,
                        help="the engine's own forward (lean: llama, qwen2), the model's public one, or auto")
    parser.add_argument("--device", default=defaults.device,
                        help="auto (the first CUDA device where there is one, else the CPU), cpu, cuda, cuda:1...")
    parser.add_argument("--weights", default=defaults.weights, choices=list(WEIGHTS),
                        help="file: run a GGUF model's block-quantised matrices as shipped; q8_0/q4_0: quantise the "
                        "linear products' weights on load (lean forward, float32); float: the dtype's float weights "
                        "(default: file for a preset or .gguf file on a CPU the kernels build on, unless --dtype is "
                        "given; float otherwise)")
    parser.add_argument("--activation-bits", type=int, default=defaults.activation_bits, choices=list(ACTIVATION_BITS),
                        help="with quantised weights on the CPU kernels: each row's activations quantised per 32 "
                        "inputs to 16 bits (the float model's top token almost everywhere) or 8 (llama.cpp's precision, "
                        "per 128 inputs over k-quants: faster, the float model's top token at 95-98 %% of positions); "
                        "default: the model's, 8 for the qwen2.5-coder-1.5b preset's file as shipped (97.6 %% there), "
                        "16 otherwise")
    parser.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=KV_CACHE_CHOICES,
                        help="what the caches keep keys and values in (default auto: float16 beside quantised weights "
                        "on the CPU kernels, as llama.cpp's cache, the model's dtype otherwise)")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                        help="most positions a sequence may reach, prompt and output together (default: the model's "
                        "context length); on a GPU each step's attention covers this many")
    parser.add_argument("--enable-torch-compile", action="store_true", default=defaults.torch_compile,
                        help="on a GPU, run the lean forward's step through torch.compile: fewer, fused kernels a step "
                        "after a minute or more of compiling at the first step")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--cache-dir", default=defaults.cache_dir,
                        help=f"converted checkpoints, packed weights and measurements (default {default_cache_dir()})")


def load_options(args: argparse.Namespace, **changes: object) -> LoadOptions:
    """The model flags (with ``changes``) as one :class:`~draftwise.models.LoadOptions`, checked (before anything slow
    starts)."""
    fields = dict(dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights,
                  activation_bits=args.activation_bits, kv_cache_dtype=args.kv_cache_dtype,
                  max_model_len=args.max_model_len, torch_compile=args.enable_torch_compile, cache_dir=args.cache_dir)
    return LoadOptions(**{**fields, **changes})


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SAMPLING_DEFAULTS
    group = parser.add_argument_group("sampling (transformers' meanings; temperature 0 = greedy)")
    group.add_argument("--temperature", type=float, default=defaults.temperature)
    group.add_argument("--top-k", type=int, default=defaults.top_k)
    group.add_argument("--top-p", type=float, default=defaults.top_p)
    group.add_argument("--min-p", type=float, default=defaults.min_p)
    group.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty)
    group.add_argument("--presence-penalty", type=float, default=defaults.presence_penalty,
                       help="subtracted from tokens already in the output (OpenAI's meaning)")
    group.add_argument("--frequency-penalty", type=float, default=defaults.frequency_penalty,
                       help="subtracted once per earlier occurrence in the output (OpenAI's meaning)")
    group.add_argument("--seed", type=int, default=defaults.seed)


def sampling_options(args: argparse.Namespace) -> dict:
    return {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
    }


def settle_heap() -> None:
    """Move every object alive now (the loaded models, tokenizers and libraries: some 400,000 of them) out of the
    garbage collector's reach. They live as long as the command does, and a full collection walks them all: about
    0.2 s that would land inside some timed step or request. Every command that loads a model calls it once, when
    everything is loaded; each owns its process, so it may."""
    gc.collect()
    gc.freeze()


def load(args: argparse.Namespace, options: LoadOptions | None = None):
    """Load ``--model`` with the model flags (or ``options``, built from them already) and say on standard error what
    loaded: the dtype, the weights, the cache's dtype, the device and the forward."""
    options = options if options is not None else load_options(args)
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidRequestError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.model, options)
    quantization = getattr(target, "quantization", None)
    weights = f", {quantization} weights" if quantization else ", float weights"
    if getattr(target, "kernel_activation_bits", None):
        weights += f" ({target.kernel_activation_bits}-bit activations)"
    if target.kv_dtype != target.dtype:
        weights += f", {str(target.kv_dtype).removeprefix('torch.')} cache"
    drafting = "" if target.exact_trees else "; drafting off: " + str(target.drafting_off_reason)
    print(f"draftwise: {args.model} in {str(target.dtype).removeprefix('torch.')}{weights} on {target.device} "
          f"({target.backend} forward{drafting})", file=sys.stderr)
    return target, tokenizer
