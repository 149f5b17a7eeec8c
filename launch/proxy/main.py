"""`python -m launch proxy --prefill URL... --decode URL... --port N`."""

from __future__ import annotations

import argparse
import sys

from launch.serve import DEFAULT_MAX_REQUEST_BYTES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem proxy",
        description="OpenAI-compatible proxy for disaggregated prefill and decode: prefill on "
        "one server, decode on another (round-robin over each list).")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill servers (python -m launch serve --kv-transfer-config ...)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="a backend request's time limit")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body in bytes, as the API server's flag; a larger one "
                   f"is answered 413 before it is read (default {DEFAULT_MAX_REQUEST_BYTES})")
    return p


def run_proxy(prefill: list[str], decode: list[str], host: str, port: int,
              timeout_s: float = 600.0, log_level: str = "warning",
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    import uvicorn

    from launch.proxy.app import PDProxy, build_app

    app = build_app(PDProxy(prefill, decode, timeout_s, max_request_bytes))
    print(f"tandem proxy: prefill {' '.join(prefill)}, decode {' '.join(decode)} on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_request_bytes < 1:
        build_parser().error("--max-request-bytes must be >= 1")
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            build_parser().error(f"not an http(s) URL: {url!r}")
    try:
        from launch.serve import require_web_stack

        require_web_stack()
    except ImportError as e:
        print(f"tandem proxy: error: {e}", file=sys.stderr)
        return 1
    try:
        run_proxy(args.prefill, args.decode, args.host, args.port, args.timeout_s,
                  args.log_level, args.max_request_bytes)
    except KeyboardInterrupt:
        pass
    return 0
