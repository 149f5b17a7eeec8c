"""A real `python -m launch serve` subprocess for tests, and a tiny tokenizer for dummy models.

Every server is stopped in a finally (SIGTERM, then SIGKILL), and the engine processes it
started are waited for, so no process outlives the test that started it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.helpers.procs import descendants, pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4: bos 1, eos 2


def make_tokenizer_dir(path: str, vocab_size: int = 512) -> str:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids (dummy:micro has 512), with
    dummy models' bos 1 / eos 2 and a ChatML template. Trained on a fixed text: deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = "the quick brown fox jumps over the lazy dog and then it runs home again " * 50
    tok.train_from_iterator([words, "hello world, how are you today?" * 20], trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
             "chat_template": CHATML},
            f,
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: str) -> None:
        self.proc = proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def engine_pids(self) -> list[int]:
        return descendants(self.proc.pid)


@contextmanager
def serve(*args: str, log_dir: str, timeout_s: float = 120.0) -> Iterator[Server]:
    """Start a server on a free port, wait for /health, and stop it (and its engine) after."""
    port = free_port()
    log_path = os.path.join(log_dir, f"serve-{port}.log")
    log = open(log_path, "wb")  # noqa: SIM115 - closed in the finally
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "serve", "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
    )
    server = Server(proc, port, log_path)
    children: list[int] = []
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(server.base_url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy after {timeout_s} s:\n{server.log()}")
            time.sleep(0.2)
        children = server.engine_pids()
        yield server
    finally:
        children = children or server.engine_pids()
        stop(proc)
        log.close()
        _reap(children)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _reap(pids: list[int], timeout_s: float = 10.0) -> None:
    """Engine processes die with the server (PDEATHSIG); kill any that did not, and say so."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if pid_alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"engine processes outlived the server: {left}"


def metric(text: str, name: str) -> float:
    """The value of the first sample of `name` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def sse_events(lines: Any) -> list[str]:
    """The data payloads of an SSE body, given its lines."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]
