"""Hostile adapter files on a rank: non-finite weights, a file far bigger than any adapter for
the model, a catastrophic pattern. Each is an answer naming what is wrong, never a crash or a
stall, and the rank serves the next adapter."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.lora import LoRARequest
from tests.helpers.lora import lora_config
from workers.lora.weights import lora_targets, max_adapter_bytes
from workers.parallel.distributed import DistEnv
from workers.runner.model_runner import ModelRunner

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def runner(lora_world) -> ModelRunner:
    r = ModelRunner(lora_config(lora_world.base, max_lora_rank=16),
                    DistEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    r.load_model()
    r.init_kv_cache()
    return r


def poisoned(src: str, dst: Path, value: float) -> tuple[str, str]:
    """A copy of adapter ``src`` with one lora_B weight set to ``value``: (path, tensor)."""
    shutil.copytree(src, dst)
    file = dst / "adapter_model.safetensors"
    tensors = load_file(str(file))
    name = sorted(n for n in tensors if "lora_B" in n)[1]
    tensors[name][0, 0] = value
    save_file(tensors, str(file))
    return str(dst), name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(runner, lora_world, tmp_path,
                                                          value) -> None:
    path, name = poisoned(lora_world.adapters[0], tmp_path / "bad", value)
    err = runner.prepare_lora(LoRARequest("bad", 7, path), "")
    assert "'bad'" in err and name in err and "non-finite" in err, err
    assert 7 not in runner.lora.slots.host
    assert runner.prepare_lora(LoRARequest("ok", 1, lora_world.adapters[0]), "") == ""


def test_weights_that_overflow_once_scaled_are_refused(lora_world, tmp_path) -> None:
    r = ModelRunner(lora_config(lora_world.base, max_lora_rank=16, dtype="float16"),
                    DistEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    r.load_model()
    r.init_kv_cache()
    path, _ = poisoned(lora_world.adapters[0], tmp_path / "huge", 1e30)
    err = r.prepare_lora(LoRARequest("huge", 7, path), "")
    assert "overflow torch.float16" in err, err


def test_a_file_past_the_model_s_largest_adapter_is_refused_unread(runner, lora_world,
                                                                   tmp_path) -> None:
    limit = max_adapter_bytes(lora_targets(runner.model), 16)
    # every projection of every layer at rank 16 in float32, and a header: the bound is tight
    # enough that the largest legitimate adapter fits and a few times it does not
    assert os.path.getsize(Path(lora_world.adapters[1]) / "adapter_model.safetensors") < limit
    big = tmp_path / "big"
    shutil.copytree(lora_world.adapters[0], big)
    with open(big / "adapter_model.safetensors", "r+b") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB that cost no disk (and are never read)
    err = runner.prepare_lora(LoRARequest("big", 8, str(big)), "")
    assert f"more than the {limit} bytes" in err and "--max-lora-rank" in err, err
    assert runner.prepare_lora(LoRARequest("ok", 1, lora_world.adapters[0]), "") == ""


def test_a_catastrophic_rank_pattern_is_refused_by_name(runner, lora_world, tmp_path) -> None:
    bad = tmp_path / "regex"
    shutil.copytree(lora_world.adapters[0], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {"(.*a){20}": 8}
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    err = runner.prepare_lora(LoRARequest("regex", 9, str(bad)), "")
    assert "rank_pattern key '(.*a){20}' is refused" in err, err
