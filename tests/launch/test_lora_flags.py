"""The LoRA options (vLLM's flags): --lora-modules in both forms, frontend-assigned ids, the
--max-lora-rank default read from the adapters' configs, the combinations refused before
anything starts, and LLM.generate's lora_request per prompt."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import LoRARequest
from launch.args import add_engine_args, engine_options
from launch.lora_modules import (
    LoRAModule,
    adapter_rank,
    files_error,
    parse_lora_module,
    per_prompt_loras,
)
from launch.serve.args import build_parser as serve_parser
from protocol.config import EngineConfig, config_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def adapter(root: Path, name: str, **cfg: object) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    (d / "adapter_model.safetensors").write_bytes(b"w")
    return str(d)


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return EngineConfig(**engine_options(p.parse_args(list(argv))))


def test_defaults_are_off() -> None:
    cfg = parse()
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (
        False, 1, None, None)
    assert cfg.lora_modules == [] and config_error(cfg) is None


def test_both_module_forms_get_ids_in_order_and_the_largest_rank(tmp_path: Path) -> None:
    a = adapter(tmp_path, "a", r=8)
    b = adapter(tmp_path, "b", r=4, rank_pattern={"q_proj": 32, "v_proj": 2})
    cfg = parse("--enable-lora", "--max-loras", "2", "--lora-modules", f"sql={a}",
                json.dumps({"name": "chat", "path": b, "base_model_name": "base"}))
    assert cfg.lora_modules == [LoRARequest("sql", 1, a), LoRARequest("chat", 2, b)]
    assert cfg.max_lora_rank == 32 and cfg.max_loras == 2
    assert config_error(cfg) is None
    assert parse("--enable-lora", "--lora-modules", f"sql={a}", "--max-lora-rank",
                 "64").max_lora_rank == 64
    assert parse("--enable-lora").max_lora_rank == 16
    args = serve_parser().parse_args(["--enable-lora", "--lora-modules", f"x={a}",
                                      json.dumps({"name": "y", "path": b})])
    assert args.lora_modules == [LoRAModule("x", a), LoRAModule("y", b, None)]


def test_adapter_rank_reads_only_the_config(tmp_path: Path) -> None:
    assert adapter_rank(adapter(tmp_path, "plain", r=16)) == 16
    assert adapter_rank(adapter(tmp_path, "pattern", r=8, rank_pattern={"x": 64})) == 64
    assert adapter_rank(adapter(tmp_path, "none")) is None
    assert adapter_rank(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("text, match", [
    ("noequals", "name=path"),
    ("=path", "name=path"),
    ('{"name": "x"}', "'path' must be a non-empty string"),
    ('{"name": "x", "path": "/p", "rank": 4}', "unknown key"),
    ('{"name": ', "invalid JSON"),
    ('["x"]', "name=path"),
])
def test_bad_modules_name_the_problem(text: str, match: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        parse_lora_module(text)


@pytest.mark.parametrize("options, match", [
    (dict(lora_modules=[LoRARequest("a", 1, "/a")]), "needs enable_lora"),
    (dict(enable_lora=True, max_loras=0), "max_loras must be >= 1"),
    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank must be >= 1"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
    (dict(enable_lora=True, lora_modules=[LoRARequest("a", 1, "/a"), LoRARequest("a", 2, "/b")]),
     "twice"),
])
def test_refused_combinations(options: dict, match: str) -> None:
    err = config_error(EngineConfig(**options))
    assert err is not None and match in err


def test_a_missing_start_up_adapter_stops_the_server_before_it_starts(tmp_path: Path) -> None:
    assert files_error([LoRARequest("ok", 1, adapter(tmp_path, "ok"))]) is None
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "serve", "--model", "dummy:micro", "--enable-lora",
         "--lora-modules", f"gone={tmp_path / 'gone'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert f"{tmp_path / 'gone'}/adapter_config.json not found" in proc.stderr


def test_lora_request_per_prompt() -> None:
    a = LoRARequest("a", 1, "/a")
    assert per_prompt_loras(None, 2, False) == [None, None]
    assert per_prompt_loras(a, 2, True) == [a, a]
    assert per_prompt_loras([a, None], 2, True) == [a, None]
    with pytest.raises(ValueError, match="1 lora requests for 2 prompts"):
        per_prompt_loras([a], 2, True)
    with pytest.raises(ValueError, match="enable_lora=True"):
        per_prompt_loras(a, 1, False)
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        per_prompt_loras(["a"], 1, True)  # type: ignore[list-item]
