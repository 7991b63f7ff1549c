"""`pdmesh client generate`: one request to a running gateway through the client SDK."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("client", help="talk to a running pdmesh gateway (gRPC)")
    sub = p.add_subparsers(dest="client_command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="generate one completion")
    g.add_argument("--address", required=True, help="the gateway's gRPC address, HOST:PORT")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text prompt")
    source.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy (default: the server's, 1.0)"
    )
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument(
        "--logprobs", type=int, default=None, help="return this many top alternatives per token"
    )
    g.add_argument("--model", default="", help="model name (default: the deployment's only model)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole call")
    g.add_argument(
        "--api-key",
        default=None,
        help="the gateway's API key (default: $PDMESH_API_KEY; the environment keeps it out of "
        "the process list)",
    )
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument(
        "--json", action="store_true", help="print JSON (one object per chunk with --stream)"
    )
    g.set_defaults(run=run_generate)


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if args.prompt is not None:
        return args.prompt
    try:
        return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError as e:
        raise ValueError(f"--prompt-ids must be comma-separated integers ({e})") from e


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        logprobs=args.logprobs,
        model=args.model,
    )


def run_generate(args: argparse.Namespace) -> int:
    from pdmesh_client import Client, GenerateError

    try:
        with Client(args.address, timeout=args.timeout, api_key=args.api_key) as client:
            if args.stream:
                _print_stream(client.stream(_prompt(args), **_settings(args)), args.json)
            else:
                _print_completion(client.generate(_prompt(args), **_settings(args)), args.json)
    except GenerateError as e:
        print(f"pdmesh client generate: {e.code}: {e.message}", file=sys.stderr)
        return 1
    return 0


def _print_stream(chunks, as_json: bool) -> None:
    last = None
    for chunk in chunks:
        last = chunk
        if as_json:
            print(json.dumps(dataclasses.asdict(chunk)), flush=True)
        else:
            print(chunk.text, end="", flush=True)
    if not as_json:
        print()
        if last is not None and last.usage is not None:
            print(
                f"[finish={last.finish_reason} prompt_tokens={last.usage.prompt_tokens} "
                f"completion_tokens={last.usage.completion_tokens}]",
                file=sys.stderr,
            )


def _print_completion(completion, as_json: bool) -> None:
    if as_json:
        print(json.dumps(dataclasses.asdict(completion)))
    else:
        print(completion.text)
