"""The device queries behind protocol/devices.py, and the checks the launcher and workers run.

torch is imported lazily and only where a GPU could exist, so a launcher on a machine without
NVIDIA devices does not pay torch's import time. Tests replace visible_cuda_devices() and
cuda_bf16_support() to simulate machines they do not have.
"""

from __future__ import annotations

import logging
import os

from protocol.devices import DeviceError, cuda_visible_text, dtype_error, plan_device

logger = logging.getLogger("tandem.devices")


def _nvidia_present() -> bool:
    # The driver's control node (or WSL's GPU node) exists wherever a CUDA device can be used.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


def visible_cuda_devices() -> int:
    """CUDA devices this process can use (0 without a driver or with a CPU-only torch)."""
    if not _nvidia_present():
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def no_cuda_reason() -> str:
    """Why no CUDA device is visible, for the error message."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not _nvidia_present():
        return "no NVIDIA driver or GPU on this machine"
    return "torch.cuda.is_available() is False"


def cuda_bf16_support(index: int = 0) -> tuple[bool, str]:
    """(bfloat16 supported, device name) of CUDA device `index`."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    name = f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    return major >= 8, name


def check_node(device: str, dtype: str, *, tp_size: int, local_ranks: int) -> str:
    """The device this node's ranks run on ("cpu" | "cuda"), or DeviceError saying what to do."""
    visible = visible_cuda_devices()
    resolved, note = plan_device(
        device,
        tp_size=tp_size,
        local_ranks=local_ranks,
        visible_cuda=visible,
        visible_text=cuda_visible_text(),
        no_cuda_reason=no_cuda_reason() if device == "cuda" and visible == 0 else "",
    )
    if note is not None:
        logger.warning("%s", note)
    if resolved == "cuda":
        ok, name = cuda_bf16_support(0)
        err = dtype_error(resolved, dtype, ok, name)
        if err is not None:
            raise DeviceError(err)
    return resolved


def check_rank(device: str, dtype: str, *, rank: int, local_rank: int, tp_size: int,
               local_ranks: int) -> str:
    """check_node for one worker, plus its own GPU; errors name the rank."""
    try:
        resolved = check_node(device, dtype, tp_size=tp_size, local_ranks=local_ranks)
        if resolved == "cuda" and local_rank >= visible_cuda_devices():
            raise DeviceError(
                f"LOCAL_RANK={local_rank} has no CUDA device: {visible_cuda_devices()} visible "
                f"({cuda_visible_text()}); use --device cpu or fewer ranks"
            )
    except DeviceError as e:
        raise DeviceError(f"rank {rank}: {e}") from None
    return resolved
