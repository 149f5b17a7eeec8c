"""Start-up device checks with simulated GPU counts: errors before anything is spawned, and a
rank's own reason (not only its exit code) in the launcher's error."""

from __future__ import annotations

import pytest

import workers.device_check as device_check
from launch import LLM
from protocol.devices import DeviceError
from tests.helpers.procs import wait_no_descendants


def test_cuda_with_fewer_gpus_than_ranks_fails_before_spawning(monkeypatch) -> None:
    monkeypatch.setattr(device_check, "visible_cuda_devices", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(DeviceError) as e:
        LLM(model="dummy:micro", tensor_parallel_size=2, device="cuda", load_tokenizer=False)
    assert str(e.value) == (
        "TP=2 needs 2 CUDA devices on this node, 1 visible (CUDA_VISIBLE_DEVICES='0'); "
        "use --device cpu or fewer ranks")
    assert wait_no_descendants(1) == []


def test_bf16_on_a_gpu_without_it_fails_before_spawning(monkeypatch) -> None:
    monkeypatch.setattr(device_check, "visible_cuda_devices", lambda: 1)
    monkeypatch.setattr(device_check, "cuda_bf16_support", lambda i=0: (False, "Tesla T4 (sm_75)"))
    with pytest.raises(DeviceError, match="bfloat16 is not supported by Tesla T4"):
        LLM(model="dummy:micro", device="auto", dtype="bfloat16", load_tokenizer=False)
    assert wait_no_descendants(1) == []


def test_cuda_without_cuda_fails_before_spawning(monkeypatch) -> None:
    monkeypatch.setattr(device_check, "visible_cuda_devices", lambda: 0)
    with pytest.raises(DeviceError, match="--device cuda, but no CUDA device is visible"):
        LLM(model="dummy:micro", device="cuda", load_tokenizer=False)


def test_cli_prints_the_reason(monkeypatch, capsys) -> None:
    from launch.cli import main

    monkeypatch.setattr(device_check, "visible_cuda_devices", lambda: 1)
    code = main(["--model", "dummy:micro", "--nproc-per-node", "2", "--device", "cuda"])
    assert code == 1
    assert "tandem: error: TP=2 needs 2 CUDA devices on this node, 1 visible" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_rank_failure_reason_reaches_the_launcher(monkeypatch) -> None:
    """The launcher's check is bypassed (it believes in two GPUs), so the real ranks start with
    device cuda on this machine and fail in their own check: the error names the rank and the
    reason it wrote, not only "exited with code 1"."""
    if device_check.visible_cuda_devices() > 0:
        pytest.skip("needs a machine without CUDA")
    monkeypatch.setattr(device_check, "check_node", lambda *a, **k: "cuda")
    with pytest.raises(RuntimeError) as e:
        LLM(model="dummy:micro", tensor_parallel_size=2, device="cuda", load_tokenizer=False,
            startup_timeout_s=120)
    text = str(e.value)
    assert "engine failed to start" in text and "exited with code 1: DeviceError: rank" in text
    assert "worker rank" in text and "no CUDA device is visible" in text
    assert wait_no_descendants(10) == []
