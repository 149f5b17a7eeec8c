"""Device planning from device counts: auto's CPU fallback, the errors and what they say."""

from __future__ import annotations

import pytest

from protocol.devices import (
    DeviceError,
    cuda_visible_text,
    dtype_error,
    plan_device,
    resolve_dtype,
)

VIS = "CUDA_VISIBLE_DEVICES='0'"


def plan(requested: str, tp: int, local: int, visible: int) -> tuple[str, str | None]:
    return plan_device(requested, tp_size=tp, local_ranks=local, visible_cuda=visible,
                       visible_text=VIS)


def test_auto_uses_cuda_when_every_rank_has_a_gpu() -> None:
    assert plan("auto", 1, 1, 1) == ("cuda", None)
    assert plan("auto", 2, 2, 8) == ("cuda", None)
    assert plan("auto", 4, 2, 2) == ("cuda", None)  # 2 nodes x 2 ranks


def test_auto_falls_back_to_cpu_with_fewer_gpus_than_ranks() -> None:
    device, note = plan("auto", 2, 2, 1)
    assert device == "cpu"
    assert note is not None and "TP=2 needs 2 CUDA devices on this node, 1 visible" in note
    assert plan("auto", 2, 2, 0) == ("cpu", None)  # no GPU at all: CPU without a warning


def test_cuda_with_too_few_gpus_says_what_to_do() -> None:
    with pytest.raises(DeviceError) as e:
        plan("cuda", 2, 2, 1)
    assert str(e.value) == (
        f"TP=2 needs 2 CUDA devices on this node, 1 visible ({VIS}); "
        "use --device cpu or fewer ranks")
    with pytest.raises(DeviceError, match="TP=8 with 4 ranks on this node needs 4 CUDA"):
        plan("cuda", 8, 4, 2)


def test_cuda_without_cuda() -> None:
    with pytest.raises(DeviceError, match="no CUDA device is visible.*use --device cpu"):
        plan_device("cuda", tp_size=1, local_ranks=1, visible_cuda=0, visible_text=VIS,
                    no_cuda_reason="torch 2.13.0+cpu is built without CUDA")


def test_cpu_is_always_fine() -> None:
    assert plan("cpu", 4, 4, 0) == ("cpu", None)
    with pytest.raises(DeviceError, match="unknown device"):
        plan("tpu", 1, 1, 0)


def test_dtype_checks() -> None:
    assert dtype_error("cuda", "bfloat16", True, "NVIDIA H100") is None
    msg = dtype_error("cuda", "bfloat16", False, "Tesla T4 (sm_75)")
    assert msg is not None and "Tesla T4 (sm_75)" in msg and "--dtype float16" in msg
    assert dtype_error("cuda", "float16", False, "Tesla T4 (sm_75)") is None
    assert dtype_error("cpu", "bfloat16", False, "cpu") is None
    assert dtype_error("cuda", "auto", False, "Tesla T4 (sm_75)") is None


def test_auto_dtype_is_the_checkpoints_on_cuda_and_float32_on_cpu() -> None:
    assert resolve_dtype("auto", "cpu", "bfloat16") == "float32"
    assert resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "cuda", "float16") == "float16"
    assert resolve_dtype("auto", "cuda", "float32") == "float32"
    assert resolve_dtype("auto", "cuda", None) == "bfloat16"  # GGUF names no dtype
    # bf16 checkpoint on a pre-Ampere GPU: float16, not an error, since bf16 was not asked for
    assert resolve_dtype("auto", "cuda", "bfloat16", bf16_supported=False) == "float16"
    assert resolve_dtype("float32", "cuda", "bfloat16") == "float32"


def test_visible_text() -> None:
    assert cuda_visible_text({"CUDA_VISIBLE_DEVICES": "1,3"}) == "CUDA_VISIBLE_DEVICES='1,3'"
    assert cuda_visible_text({}) == "CUDA_VISIBLE_DEVICES unset"
