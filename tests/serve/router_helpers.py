"""The real vllm-router binary in front of Tandem servers, for tests and benchmarks: started on
a free port, waited for, and stopped (SIGTERM, then SIGKILL) however the caller ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.serve.serve_helpers import free_port, stop

ROUTER = shutil.which("vllm-router")


def events_config(port: int, replay_port: int) -> str:
    return ('{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://127.0.0.1:{port}", '
            f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}"}}')


@contextmanager
def router(*args: str, log_dir: str, timeout_s: float = 60.0) -> Iterator[str]:
    """vllm-router with `args` on a free port; yields its base URL once it answers."""
    assert ROUTER is not None
    port = free_port()
    log_path = os.path.join(log_dir, f"router-{port}.log")
    log = open(log_path, "wb")  # noqa: SIM115 - closed in the finally
    proc = subprocess.Popen(
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
         str(free_port()), "--log-level", "debug", *args],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {proc.returncode}:\n"
                                   + open(log_path, errors="replace").read()[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vllm-router did not come up:\n"
                                   + open(log_path, errors="replace").read()[-3000:])
            time.sleep(0.2)
        yield url
    finally:
        stop(proc, grace_s=10.0)
        log.close()
