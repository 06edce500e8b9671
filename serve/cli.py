"""`zoo serve CKPT`: its flags (:func:`add_serve_parser`, read by zoo/cli.py: this module's top imports stay light,
no JAX) and its body (:func:`run`): load the model, start the engine's thread, serve HTTP until Ctrl-C."""

from __future__ import annotations

import argparse
import sys

from zoo.console import add_dtype_flag
from zoo.errors import UserError

INSTALL = "pip install 'lmzoo[serve]'"


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo serve`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser(
        "serve", help="serve a zoo checkpoint over HTTP with the OpenAI API (completions, chat, tool calls)",
        description="Serve a zoo checkpoint with an OpenAI-compatible HTTP API: GET /v1/models, POST "
                    "/v1/completions and /v1/chat/completions (streamed with \"stream\": true), and GET /v1/health. "
                    "Requests are decoded together by the inference engine (continuous batching over a paged "
                    "KV cache). Needs the serve extra: " + INSTALL)
    p.add_argument("ckpt", metavar="CKPT",
                   help="the zoo checkpoint to serve: a converted model or a training run's final/ folder (an "
                        "adapter checkpoint is served merged over its base)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every "
                        "interface: the server has no authentication)")
    p.add_argument("--port", type=int, default=8000, help="the TCP port to listen on (default 8000)")
    p.add_argument("--max-seqs", type=int, default=16, metavar="N",
                   help="requests decoded at once; more wait their turn (default 16)")
    p.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="tokens of one request, prompt and answer together (default: the model's context, at most "
                        "4096); a longer request is refused")
    p.add_argument("--page-size", type=int, default=16, metavar="N",
                   help="tokens per page of the KV cache (default 16)")
    add_dtype_flag(p)
    p.add_argument("--adapter", action="append", metavar="NAME=PATH",
                   help="a LoRA adapter checkpoint trained on CKPT, served as the model NAME: a request whose "
                        "\"model\" is NAME decodes with it (the flag may repeat)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the name of CKPT's model in requests and GET /v1/models (default: its folder's name, the "
                        "run's for a final/ folder)")
    return p


def _check(args: argparse.Namespace) -> None:
    """Flags out of range: one-line errors before anything loads."""
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: give a TCP port from 1 to 65535")
    if args.max_seqs < 1 or args.page_size < 1 or (args.max_len is not None and args.max_len < 2):
        raise UserError("need --max-seqs >= 1, --page-size >= 1 and --max-len >= 2")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError(f"zoo serve needs fastapi and uvicorn; install them: {INSTALL}") from None


def run(args: argparse.Namespace) -> None:
    """`zoo serve CKPT`: load it and its adapters, then answer HTTP requests until interrupted."""
    _check(args)
    import uvicorn

    from serve.app import make_app
    from serve.model import load_served, parse_adapters
    from serve.runner import Runner

    served = load_served(args.ckpt, name=args.served_model_name, adapters=parse_adapters(args.adapter),
                         max_seqs=args.max_seqs, max_len=args.max_len, page_size=args.page_size, dtype=args.dtype)
    runner = Runner(served.engine)
    runner.start()
    names = ", ".join((served.name, *served.adapters))
    print(f"serving {names} at http://{args.host}:{args.port}/v1 (max {served.max_len} tokens a request)",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(make_app(served, runner), host=args.host, port=args.port, log_level="warning")
    finally:
        runner.close()
