"""`python -m launch serve`: start the engine as the launcher does, then serve HTTP on it."""

from __future__ import annotations

import signal
import sys
from typing import Any

from launch.args import engine_options
from launch.multimodal.args import multimodal_kwargs
from launch.serve import require_web_stack
from launch.serve.args import build_parser


def _stop_on_sigterm() -> None:
    # uvicorn turns SIGTERM into a graceful stop and then re-raises it with the handler that
    # was there before; raising KeyboardInterrupt there lets `finally` stop the engine.
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from launch.lora_modules import files_error
    from protocol.config import EngineConfig, config_error

    options = engine_options(args)
    err = config_error(EngineConfig(**options)) or files_error(options.get("lora_modules", []))
    if err is not None:
        parser.error(err)
    clash = {m.name for m in args.lora_modules} & set(args.served_model_name or [args.model])
    if clash:
        parser.error(f"--lora-modules: {sorted(clash)[0]!r} is also the base model's served name")
    if args.nnodes > 1 and args.node_rank > 0:
        parser.error("serve runs on node 0; start other nodes with `python -m launch --node-rank`")
    try:
        require_web_stack()
    except ImportError as e:
        print(f"tandem serve: error: {e}", file=sys.stderr)
        return 1
    import uvicorn

    from launch.llm import LLM
    from launch.serve.adapters import ServedAdapters
    from launch.serve.app import build_app
    from launch.serve.context import ServerContext
    from launch.serve.engine import AsyncEngine

    _stop_on_sigterm()
    world = args.nproc_per_node * args.nnodes
    llm = None
    try:
        llm = LLM(
            args.model,
            tensor_parallel_size=world,
            nnodes=args.nnodes,
            master_addr=args.master_addr,
            master_port=args.master_port or (29500 if args.nnodes > 1 else None),
            load_tokenizer=args.tokenizer is None,
            **engine_options(args),
            **multimodal_kwargs(args),
        )
        tokenizer = llm.tokenizer
        if args.tokenizer is not None:
            from launch.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        served_names = args.served_model_name or [args.model]
        ctx = ServerContext(
            engine=AsyncEngine(llm, tokenizer),
            served_names=served_names,
            model_path=args.model,
            api_key=args.api_key,
            max_n=args.max_n,
            max_request_bytes=args.max_request_bytes,
            adapters=ServedAdapters(args.lora_modules, llm.config.lora_modules, served_names[0]),
        )
        config = uvicorn.Config(
            build_app(ctx),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        print(
            f"tandem serve: {args.model} (TP={world}) on http://{args.host}:{args.port}/v1",
            file=sys.stderr,
            flush=True,
        )
        server.run()
        return 0 if server.started else 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"tandem serve: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if llm is not None:
            llm.shutdown()
