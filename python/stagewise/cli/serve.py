"""``stagewise serve MODEL``: load a model (in this process, or as pipeline stages with every layout
option of ``generate``) and answer OpenAI-compatible requests over HTTP until stopped (Ctrl-C or
SIGTERM stop the server, then the stages). See :mod:`stagewise.serve.app` for the endpoints.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from stagewise import startup_gc
from stagewise.cli.model_args import add_model_arguments, config_checks, model_problems, open_pipeline
from stagewise.cli.prompt_args import PromptBatch, report
from stagewise.pipeline.lines import TIME_FORMAT, log_line
from stagewise.serve.openai import MAX_REQUEST_BYTES
from stagewise.serve.reasoning import PARSERS

PROG = "stagewise serve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="an HF folder, a .gguf file, or an embedded model name (smollm2-135m); "
                             "with --plan, the plan's model")
    add_model_arguments(parser, max_restarts=3, server=True)
    add_server_arguments(parser)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own options (shared with ``stagewise launch PLAN --serve``)."""
    s = parser.add_argument_group("server (serve, launch --serve)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, printed)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' to /v1/* (default: $STAGEWISE_API_KEY; "
                        "none: open)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the model argument)")
    s.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests that may wait beyond the --max-num-seqs running ones; more get 503 with "
                        "Retry-After (default 64)")
    s.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                   help="max_tokens of a request that gives none (default 256)")
    s.add_argument("--allow-image-fetch", action="store_true",
                   help="fetch a chat's http(s) image URLs (off: data: URLs only); the server then reaches "
                        "whatever address a client names, its own network included")
    s.add_argument("--max-images", type=int, default=16, metavar="N", help="images a request may hold (default 16)")
    s.add_argument("--image-fetch-timeout", type=float, default=10.0, metavar="S",
                   help="seconds one image URL may take to fetch, first byte to last (default 10)")
    s.add_argument("--max-image-bytes", type=int, default=20 << 20, metavar="N",
                   help="largest image file a chat may send or name, in bytes (default 20 MiB)")
    s.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, metavar="N",
                   help="largest request body, in bytes; a larger one gets 413 before it is read (default 32 MiB: "
                        "one image of the default --max-image-bytes fits as a data: URL)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="render chats with this Jinja template instead of the checkpoint's")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS),
                   help="a reasoning model's <think>...</think> goes to reasoning_content, and an output "
                        "constraint holds after it")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def server_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting < 0:
        problems.append(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.default_max_tokens < 1:
        problems.append(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if not args.image_fetch_timeout > 0:
        problems.append(f"--image-fetch-timeout must be > 0 seconds, got {args.image_fetch_timeout:g}")
    if args.max_images < 0:
        problems.append(f"--max-images must be >= 0, got {args.max_images}")
    if args.max_image_bytes < 1:
        problems.append(f"--max-image-bytes must be >= 1, got {args.max_image_bytes}")
    if args.max_request_bytes < 1:
        problems.append(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.chat_template is not None:
        try:
            Path(args.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as err:
            problems.append(f"--chat-template: cannot read {args.chat_template!r}: {err}")
    return problems


def listen(args: argparse.Namespace, prog: str) -> socket.socket | None:
    """The server's socket, bound before the model loads (a port in use is said at once)."""
    try:
        return socket.create_server((args.host, args.port))
    except OSError as err:
        report(prog, [f"cannot listen on {args.host}:{args.port}: {err}"])
        return None


def serving_threads(args: argparse.Namespace) -> tuple[int | None, tuple[int, int] | None]:
    """The server's torch threads, and its steps' ``(one-token, larger)`` threads when they differ
    (:meth:`~stagewise.frontend.local.LocalBackend.set_step_threads`). ``--threads`` as given; for a
    model in the server's own CPU process (and no OMP_NUM_THREADS), every core the process may use
    for a step of several tokens and one fewer for a step of one (a lone stream's decode). The HTTP
    loop writes every token out between the steps, and a torch thread it preempts holds up every
    kernel's other threads: on 2 cores a lone stream's token took 18.6 ms on 2 threads, 12.2 on 1.
    A step of several rows, or a prompt's chunk, gains more from the core than it loses: the
    system-prompt workload at 2 requests a second on 2 cores had a TPOT p50 of 168 ms with every
    step on one thread, 33 ms with the steps of 2 tokens or more on both."""
    if args.threads is not None or args.plan or args.stages * args.tp * args.pcp > 1 or args.device != "cpu" \
            or "OMP_NUM_THREADS" in os.environ:
        return args.threads, None
    from stagewise.launch.local import usable_cores

    cores = usable_cores()
    return max(1, cores - 1), ((cores - 1, cores) if cores > 1 else None)


def run(args: argparse.Namespace) -> int:
    problems = model_problems(args) + server_problems(args)
    if problems:
        return report(PROG, problems)
    startup_gc.pause()  # until the model is loaded: see stagewise.startup_gc
    try:
        problems = config_checks(args, PromptBatch(), max_new_tokens=1)
        if problems:
            return report(PROG, problems)
        sock = listen(args, PROG)
        if sock is None:
            return 2
        args.threads, args.step_threads = serving_threads(args)
        try:
            pipe = open_pipeline(args, PROG)
        except BaseException:
            sock.close()
            raise
    finally:
        startup_gc.settle()
    if pipe is None:
        sock.close()
        return 1
    return serve_closing(pipe, args, PROG, sock)


def serve_closing(pipe, args: argparse.Namespace, prog: str, sock: socket.socket | None = None) -> int:
    """:func:`serve` on ``sock`` (bound now when None) until stopped, then close both."""
    try:
        if sock is None:
            sock = listen(args, prog)
            if sock is None:
                return 2
        return serve(pipe, args, sock, prog)
    finally:
        pipe.close()
        if sock is not None:
            sock.close()


def log_config(level: str) -> dict:
    """uvicorn's logging with the time at the start of each line (as a stage's lines have it,
    :func:`~stagewise.pipeline.lines.log_line`), and stagewise's own logger (a stage restarted, ...)
    through the same handler and format."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = f"%(asctime)s.%(msecs)03d {formatter['fmt']}"
        formatter["datefmt"] = TIME_FORMAT
    config["loggers"]["stagewise"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def serve(pipe, args: argparse.Namespace, sock: socket.socket, prog: str) -> int:
    """Answer requests on ``sock`` until stopped (the caller closes ``pipe``)."""
    import uvicorn

    from stagewise.serve.app import build_app
    from stagewise.serve.media import MediaLimits

    model = getattr(args, "model", None)
    name = args.served_model_name or model or (pipe.plan.model if pipe.plan is not None else "model")
    key = args.api_key or os.environ.get("STAGEWISE_API_KEY") or None
    media = MediaLimits(max_bytes=args.max_image_bytes, timeout_s=args.image_fetch_timeout,
                        fetch=args.allow_image_fetch, max_images=args.max_images)
    app = build_app(pipe, model_name=name, api_key=key, max_waiting=args.max_waiting,
                    default_max_tokens=args.default_max_tokens, media=media, max_request_bytes=args.max_request_bytes,
                    chat_template=Path(args.chat_template).read_text() if args.chat_template else None,
                    reasoning_parser=args.reasoning_parser, step_threads=getattr(args, "step_threads", None))
    host, port = sock.getsockname()[:2]
    here = ""
    if pipe.plan is None:  # the model computes in this process
        import torch

        here = f", {torch.get_num_threads()} torch thread(s) here"
    log_line(f"{prog}: {name} on http://{host}:{port}/v1 ({'API key required' if key else 'no API key'}{here})")
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, log_config=log_config(args.log_level),
                                           lifespan="on", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0 if server.started else 1
