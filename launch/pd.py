"""`python -m launch pd`: a whole disaggregated prefill/decode set on this host, for trying and
benchmarking P/D with one command.

    python -m launch pd --prefill-tp 1 --decode-tp 2 --port 8000 --model dummy:tiny

starts ``--num-prefill`` prefill servers (TP ``--prefill-tp``) and ``--num-decode`` decode
servers (TP ``--decode-tp``), each a ``python -m launch serve`` on a free loopback port with
``--kv-transfer-config '{"kv_role": "kv_both", ...}'``, waits until they are healthy, and
serves the proxy (launch/proxy/) on ``--port``. Every other flag (model, dtype, KV size, ...)
goes to every server. Stopping it (Ctrl-C, SIGTERM) stops them all; they die with it even
when it is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from launch.processes import _die_with_parent, free_port

_RESERVED = ("--port", "--host", "--nproc-per-node", "--nproc_per_node", "--kv-transfer-config")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem pd",
        description="Start prefill and decode servers and the P/D proxy in front of them; "
        "other flags go to every server (see python -m launch serve --help).")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--kv-connector", default="auto", choices=["auto", "nixl", "tcp", "shm"])
    p.add_argument("--kv-load-failure-policy", default="recompute",
                   choices=["recompute", "fail"])
    p.add_argument("--host", default="127.0.0.1", help="the proxy's address")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None,
                   help="write each server's output to DIR/<role><i>.log (default: inherit)")
    return p


class Servers:
    """The serve processes of one set; stopped together."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes], str]] = []
        self._logs: list[Any] = []

    def start(self, name: str, tp: int, kv: dict[str, str], rest: list[str],
              log_dir: str | None) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "launch", "serve", "--port", str(port),
               "--nproc-per-node", str(tp), "--kv-transfer-config", json.dumps(kv), *rest]
        out: Any = None
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            out = open(os.path.join(log_dir, f"{name}.log"), "wb")  # noqa: SIM115
            self._logs.append(out)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                preexec_fn=_die_with_parent, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        self.procs.append((name, proc, url))
        return url

    def wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        for name, proc, url in self.procs:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} server exited with code {proc.returncode}")
                try:
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} server not healthy after {timeout_s} s")
                time.sleep(0.2)

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for f in self._logs:
            f.close()


def _max_request_bytes(server_args: list[str]) -> int:
    """The servers' --max-request-bytes (it goes to them with the other flags): the proxy in
    front of them reads no larger body than they would."""
    from launch.serve import DEFAULT_MAX_REQUEST_BYTES

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    return int(p.parse_known_args(server_args)[0].max_request_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if a.split("=", 1)[0] in _RESERVED]
    if bad:
        parser.error(f"{bad[0]} is set by pd itself (see --prefill-tp, --decode-tp, --port)")
    if min(args.prefill_tp, args.decode_tp, args.num_prefill, args.num_decode) < 1:
        parser.error("TP sizes and server counts must be >= 1")
    kv = {"kv_role": "kv_both", "kv_connector": args.kv_connector,
          "kv_load_failure_policy": args.kv_load_failure_policy}

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    servers = Servers()
    try:
        prefill = [servers.start(f"prefill{i}", args.prefill_tp, kv, rest, args.log_dir)
                   for i in range(args.num_prefill)]
        decode = [servers.start(f"decode{i}", args.decode_tp, kv, rest, args.log_dir)
                  for i in range(args.num_decode)]
        servers.wait_healthy(args.startup_timeout_s)
        from launch.proxy.main import run_proxy

        run_proxy(prefill, decode, args.host, args.port,
                  max_request_bytes=_max_request_bytes(rest))
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"tandem pd: error: {e}", file=sys.stderr)
        return 1
    finally:
        servers.stop()
