"""Which device a node's ranks run on, decided from device counts alone (no torch here).

The launcher decides before it spawns anything, and each worker decides again from the same
inputs (a worker may be started by torchrun), so both give the same answer and the same errors.
Errors say what to do; they are one line, since the launcher prints the first line.
"""

from __future__ import annotations

import os


class DeviceError(ValueError):
    """The requested device, rank count or dtype cannot run on this node."""


def cuda_visible_text(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """CUDA_VISIBLE_DEVICES as the user should see it in an error message."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def _ranks_text(tp_size: int, local_ranks: int) -> str:
    if tp_size == local_ranks:
        return f"TP={tp_size}"
    return f"TP={tp_size} with {local_ranks} ranks on this node"


def plan_device(
    requested: str,
    *,
    tp_size: int,
    local_ranks: int,
    visible_cuda: int,
    visible_text: str,
    no_cuda_reason: str = "",
) -> tuple[str, str | None]:
    """(device, note): the device this node's ranks use, and why "auto" chose CPU (or None).

    "auto": CUDA when every local rank gets a GPU of its own, else CPU, so a multi-rank run on a
    machine with fewer GPUs than ranks still works (slowly) instead of failing. "cuda": an error
    that says what to do when a rank would have no GPU.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"unknown device {requested!r}; expected auto, cpu or cuda")
    if requested == "cpu":
        return "cpu", None
    if requested == "cuda" and visible_cuda == 0:
        why = f" ({no_cuda_reason})" if no_cuda_reason else ""
        raise DeviceError(
            f"--device cuda, but no CUDA device is visible{why}, {visible_text}; "
            "use --device cpu"
        )
    if local_ranks > visible_cuda:
        if requested == "auto":
            if visible_cuda == 0:
                return "cpu", None
            return "cpu", (
                f"{_ranks_text(tp_size, local_ranks)} needs {local_ranks} CUDA devices on this "
                f"node, {visible_cuda} visible ({visible_text}): running every rank on CPU "
                "(--device cuda makes this an error)"
            )
        raise DeviceError(
            f"{_ranks_text(tp_size, local_ranks)} needs {local_ranks} CUDA devices on this node, "
            f"{visible_cuda} visible ({visible_text}); use --device cpu or fewer ranks"
        )
    return "cuda", None


def dtype_error(device: str, dtype: str, bf16_supported: bool, device_name: str) -> str | None:
    """Why this dtype cannot run on this device, or None. bfloat16 needs an Ampere-or-newer
    GPU (compute capability 8.0); float16 and float32 run on every CUDA device and on CPU."""
    if dtype == "auto":
        return None  # resolve_dtype() picks one this device runs
    if dtype not in ("float32", "bfloat16", "float16"):
        return f"unknown dtype {dtype!r}; expected auto, float32, bfloat16 or float16"
    if device == "cuda" and dtype == "bfloat16" and not bf16_supported:
        return (
            f"--dtype bfloat16 is not supported by {device_name} (bfloat16 needs compute "
            "capability 8.0 or newer); use --dtype float16 or --dtype float32"
        )
    return None


def resolve_dtype(requested: str, device: str, checkpoint_dtype: str | None,
                  bf16_supported: bool = True) -> str:
    """The dtype a rank runs in: `requested` unless it is "auto".

    "auto" on CPU is float32 here; a rank refines it (workers/cpu_dtype.py: bfloat16 for a
    bf16 checkpoint on a CPU with native bf16 that measures it faster). On CUDA it is the
    checkpoint's own dtype (config.json's torch_dtype / dtype), bfloat16 where the checkpoint
    names none (GGUF: its weights are quantized, and bf16 is what the Triton kernels and tensor
    cores are built for); a bfloat16 checkpoint on a GPU older than compute capability 8.0 runs
    in float16, since the user did not ask for bf16.
    """
    if requested != "auto":
        return requested
    if device != "cuda":
        return "float32"
    dtype = checkpoint_dtype if checkpoint_dtype in ("float32", "bfloat16", "float16") \
        else "bfloat16"
    if dtype == "bfloat16" and not bf16_supported:
        return "float16"
    return dtype
