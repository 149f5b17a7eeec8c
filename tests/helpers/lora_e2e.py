"""End-to-end LoRA plumbing without a model: a real LLM (engine core process, real ZeroMQ) whose
ranks are tests/helpers/lora_stub_worker.py processes, and PEFT-shaped adapter directories.

Every process started here is stopped in a finally, whatever the test did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from launch.llm import LLM, _engine_config
from launch.processes import free_port
from protocol.lora_files import content_hash
from tests.engine_core.fake_worker import lora_token, next_token
from tests.helpers.procs import wait_no_descendants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_adapter(root: Path, name: str, r: int = 8, weights: bytes = b"w", **extra: Any) -> str:
    """A directory with the two files of a PEFT adapter (the stub reads only the config)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj"], **extra}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    (d / "adapter_model.safetensors").write_bytes(name.encode() + weights)
    return str(d)


def expected_tokens(prompt: list[int], max_tokens: int, adapter: str | None) -> list[int]:
    """What the stub ranks sample for ``prompt`` (greedy, alone) with the adapter at path
    ``adapter`` (None: the base model)."""
    h = content_hash(adapter) if adapter is not None else ""
    toks, out = list(prompt), []
    for _ in range(max_tokens):
        t = lora_token(next_token(toks), h)
        toks.append(t)
        out.append(t)
    return out


@contextmanager
def stub_llm(world: int = 2, **options: Any) -> Iterator[LLM]:
    """An LLM over ``world`` stub ranks (TP), LoRA enabled unless options say otherwise."""
    options.setdefault("enable_lora", True)
    port = free_port()
    config = _engine_config("dummy:tiny", world, dict(options))
    env = dict(os.environ, TANDEM_CONFIG=msgspec.json.encode(config).decode(),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               PYTHONPATH=ROOT)
    env.pop("TANDEM_ENDPOINTS", None)
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.helpers.lora_stub_worker"],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT)
        for r in range(world)
    ]
    llm = None
    try:
        llm = LLM("dummy:tiny", tensor_parallel_size=world, start_workers=False, master_port=port,
                  load_tokenizer=False, startup_timeout_s=120, **options)
        yield llm
    finally:
        if llm is not None:
            llm.shutdown()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        assert not wait_no_descendants(10.0), "a process outlived the test"
