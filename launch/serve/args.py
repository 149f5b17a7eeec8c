"""Flags of `python -m launch serve`: the launcher's process and engine options plus HTTP ones."""

from __future__ import annotations

import argparse

from launch.args import add_engine_args, add_torchrun_args
from launch.multimodal.args import add_multimodal_args
from launch.serve.body import DEFAULT_MAX_REQUEST_BYTES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem serve",
        description="Serve a model over an OpenAI-compatible HTTP API (vLLM's request and "
        "response shapes).",
    )
    add_torchrun_args(p)
    add_engine_args(p)
    add_multimodal_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in `model` (default: --model); the first one is reported",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every request except /health, "
        "/metrics and /version",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (tokenizer.json [+ tokenizer_config.json]) when the model's "
        "own is missing, e.g. for dummy:* models",
    )
    g.add_argument("--log-level", default="warning", help="uvicorn's log level")
    g.add_argument(
        "--max-n", type=int, default=128, help="largest `n` (choices per prompt) accepted"
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body in bytes; a larger one is answered 413 "
        f"(default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    return p
