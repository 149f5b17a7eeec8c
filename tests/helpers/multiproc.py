"""Run tests/helpers/tp_run.py as N real ranks (gloo), with a timeout and guaranteed cleanup."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(tmp_dir: str, model: str, prompts: list[list[int]], world_size: int = 2,
           max_new: int = 0, eos: int | None = None, timeout_s: float = 120) -> list[dict]:
    """Start world_size ranks, wait for all (killing every one on timeout/failure), and return
    each rank's results as saved by tp_run.py: {"logits": [tensor per prompt], "generated",
    "greedy"} (safetensors and JSON, never a pickle)."""
    out = os.path.join(tmp_dir, "tp_out")
    spec = os.path.join(tmp_dir, "spec.json")
    with open(spec, "w") as f:
        json.dump({"model": model, "prompts": prompts, "max_new": max_new, "eos": eos,
                   "out": out}, f)
    run_ranks(os.path.join(HERE, "tp_run.py"), [spec], world_size, timeout_s)
    return [_load_rank(os.path.join(out, f"rank{r}")) for r in range(world_size)]


def _load_rank(base: str) -> dict:
    with open(base + ".json") as f:
        result = json.load(f)
    tensors = load_file(base + ".safetensors")
    result["logits"] = [tensors[f"logits.{i}"] for i in range(result.pop("num_prompts"))]
    return result


def run_ranks(script: str, args: list[str], world_size: int, timeout_s: float) -> None:
    """Run `python script *args` as world_size torchrun-style ranks on this host; fails (after
    killing every rank) when one times out or exits non-zero."""
    port = _free_port()
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, script, *args], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for rank, p in enumerate(procs):
            try:
                output, _ = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                raise AssertionError(f"rank {rank} timed out after {timeout_s}s") from e
            if p.returncode != 0:
                raise AssertionError(f"rank {rank} exited {p.returncode}:\n{output.decode()}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
