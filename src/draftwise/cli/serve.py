"""``draftwise serve``: the OpenAI-compatible server, in this process or as replicas on Ray Serve (``--ray``)."""

from __future__ import annotations

import argparse
import os
import sys

from ..api import DEFAULT_METHOD
from ..decoding.batch import DEFAULT_MAX_BATCH, DEFAULT_MAX_PREFILL_ROWS
from ..decoding.engine import DEFAULT_BUDGET
from ..decoding.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES
from ..errors import InvalidRequestError
from ..files import read_text_file
from ..models import LoadOptions
from ..serve.access import API_KEY_VARIABLE, exposure_warning
from ..serve.defaults import DEFAULT_MAX_TOKENS, DEFAULT_MAX_WAITING
from . import common
from .common import add_model_arguments, load_options, settle_heap


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible server (completions, chat, streaming, metrics)")
    serve.add_argument("--method", default=DEFAULT_METHOD,
                       help=f"decoding method of every request (default {DEFAULT_METHOD})")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                       help=f"most sequences decoded at once (default {DEFAULT_MAX_BATCH})")
    serve.add_argument("--max-prefill-rows", type=int, default=DEFAULT_MAX_PREFILL_ROWS,
                       help="most prompt tokens prefilled in one step: longer prompts are prefilled in pieces "
                            f"between decoding steps (default {DEFAULT_MAX_PREFILL_ROWS})")
    serve.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                       help=f"most requests waiting for a slot; more are answered 503 (default {DEFAULT_MAX_WAITING})")
    serve.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                       help=f"most draft nodes per sequence and step (default {DEFAULT_BUDGET})")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the keys and values of earlier prompts and outputs for requests that begin the same "
                            "way, bitwise the same tokens (default on; --no-enable-prefix-caching: off)")
    serve.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_BYTES >> 20,
                       help="most MiB of keys and values kept for prefix caching, least recently used dropped first "
                            f"(default {DEFAULT_PREFIX_CACHE_BYTES >> 20})")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                       help=f"tokens generated when a request gives no max_tokens (default {DEFAULT_MAX_TOKENS})")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    access = serve.add_argument_group("access control")
    access.add_argument("--api-key", default=None,
                        help=f"requests must carry 'Authorization: Bearer KEY' (default: the {API_KEY_VARIABLE} "
                        "environment variable where set, as vLLM's server; else no key)")
    access.add_argument("--api-key-file", default=None, help="read the API key from this file (its first line)")
    access.add_argument("--protect-metrics", action="store_true",
                        help="/metrics needs the API key too (default: open to scrapers, as /health)")
    ray_group = serve.add_argument_group("scale-out on Ray Serve (pip install 'draftwise[ray]')")
    ray_group.add_argument("--ray", action="store_true", help="run replicas of the server on Ray Serve")
    ray_group.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    ray_group.add_argument("--autoscale", default=None, metavar="MIN,MAX",
                           help="autoscale between MIN and MAX replicas on ongoing requests (instead of --replicas)")
    ray_group.add_argument("--address", default=None,
                           help="Ray cluster to join: auto, or ray://head:10001 (default: start a local one)")
    ray_group.add_argument("--cpus-per-replica", type=float, default=None,
                           help="CPUs each replica reserves (default: --threads, or 1)")
    ray_group.add_argument("--gpus-per-replica", type=float, default=None,
                           help="GPUs each replica reserves (default: 1 with --device cuda, else 0)")
    ray_group.add_argument("--no-session-affinity", action="store_true",
                           help="ignore the x-session-id header (power-of-two-choices routing for every request)")
    add_model_arguments(serve)
    serve.set_defaults(handler=run)


def api_key_of(args: argparse.Namespace) -> str | None:
    """The API key the server asks for: ``--api-key``, the first line of ``--api-key-file``, or the
    :data:`API_KEY_VARIABLE` environment variable; ``None`` where none is given."""
    if args.api_key is not None and args.api_key_file is not None:
        raise InvalidRequestError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        lines = read_text_file(args.api_key_file, "API key file").strip().splitlines()
        if not lines or not lines[0].strip():
            raise InvalidRequestError(f"API key file {args.api_key_file} is empty")
        return lines[0].strip()
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE)
    if key is not None and not key.strip():
        raise InvalidRequestError("the API key is empty")
    if args.protect_metrics and key is None:
        raise InvalidRequestError("--protect-metrics asks for the API key on /metrics: give one with --api-key")
    return key


def _serve_dependencies():
    try:
        import uvicorn

        from ..serve import ServingEngine, create_app
    except ImportError as error:
        raise InvalidRequestError(f"the server needs its extra: pip install 'draftwise[serve]' ({error})") from None
    return uvicorn, ServingEngine, create_app


def run(args: argparse.Namespace) -> int:
    """Start the OpenAI-compatible server."""
    from ..drafters import check_method

    check_method(args.method)
    if min(args.max_batch, args.max_waiting, args.default_max_tokens, args.max_prefill_rows) < 1:
        raise InvalidRequestError("--max-batch, --max-waiting, --max-prefill-rows and --default-max-tokens must be "
                                  "positive")
    if args.prefix_cache_mb < 0:
        raise InvalidRequestError("--prefix-cache-mb must be >= 0")
    prefix_cache_bytes = (args.prefix_cache_mb << 20) if args.enable_prefix_caching else 0
    options = load_options(args)
    api_key = api_key_of(args)
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(f"draftwise: warning: {warning}", file=sys.stderr)
    if args.ray:
        return _serve_on_ray(args, options, api_key, prefix_cache_bytes)
    ray_only = [flag for flag, value in (("--replicas", args.replicas), ("--autoscale", args.autoscale),
                                         ("--address", args.address), ("--cpus-per-replica", args.cpus_per_replica),
                                         ("--gpus-per-replica", args.gpus_per_replica)) if value is not None]
    if ray_only or args.no_session_affinity:
        raise InvalidRequestError(f"{', '.join(ray_only) or '--no-session-affinity'} needs --ray")
    uvicorn, ServingEngine, create_app = _serve_dependencies()
    from ..serve.engine import on_passing_thread

    def build():
        target, tokenizer = common.load(args, options)
        if tokenizer is None:
            raise InvalidRequestError(f"{args.model} has no tokenizer: the server needs one")
        return ServingEngine(target, tokenizer, args.method, max_batch=args.max_batch, max_waiting=args.max_waiting,
                             budget=args.budget, max_prefill_rows=args.max_prefill_rows,
                             prefix_cache_bytes=prefix_cache_bytes)

    # (torch's work then runs on the engine's thread alone: see on_passing_thread)
    engine = on_passing_thread(build)
    settle_heap()
    name = args.served_model_name or args.model
    app = create_app(engine, name, args.default_max_tokens, api_key=api_key, protect_metrics=args.protect_metrics)
    print(f"draftwise: serving {name} with {args.method} on http://{args.host}:{args.port}/v1 "
          f"(batch up to {args.max_batch})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _autoscale_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise InvalidRequestError(f"--autoscale takes MIN,MAX (two integers), not {text!r}") from None
    return low, high


def _serve_on_ray(args: argparse.Namespace, options: LoadOptions, api_key: str | None, prefix_cache_bytes: int) -> int:
    """``draftwise serve --ray``: the same server, its replicas run by Ray Serve."""
    autoscale = _autoscale_range(args.autoscale)
    if autoscale is not None and args.replicas is not None:
        raise InvalidRequestError("give --replicas or --autoscale, not both")
    replicas = args.replicas if args.replicas is not None else 1
    if replicas < 1:
        raise InvalidRequestError("replicas must be at least 1")
    try:
        from ..serve.ray import build_app
        from ..serve.ray import run as run_on_ray
    except ImportError as error:
        raise InvalidRequestError(f"--ray needs its extra: pip install 'draftwise[ray]' ({error})") from None
    cpus = args.cpus_per_replica if args.cpus_per_replica is not None else float(args.threads or 1)
    gpus = args.gpus_per_replica
    if gpus is None:  # (device auto: a GPU where this machine has one)
        gpus = 1.0 if options.resolved_device.type == "cuda" else 0.0
    name = args.served_model_name or args.model
    app = build_app(args.model, served_model_name=name, method=args.method, replicas=replicas,
                    autoscale=autoscale, cpus_per_replica=cpus, gpus_per_replica=gpus,
                    threads=args.threads, max_batch=args.max_batch, max_waiting=args.max_waiting, budget=args.budget,
                    max_prefill_rows=args.max_prefill_rows, default_max_tokens=args.default_max_tokens,
                    session_affinity=not args.no_session_affinity, api_key=api_key,
                    protect_metrics=args.protect_metrics, prefix_cache_bytes=prefix_cache_bytes, options=options)
    scale = f"{autoscale[0]} to {autoscale[1]} replicas" if autoscale else f"{replicas} replica(s)"
    print(f"draftwise: serving {name} with {args.method} on Ray Serve, {scale} of {cpus:g} CPU(s), "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    run_on_ray(app, address=args.address, host=args.host, port=args.port)
    return 0
