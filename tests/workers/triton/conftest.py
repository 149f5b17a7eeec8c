"""The Triton kernels run on a GPU where there is one, else on CPU tensors under the Triton
interpreter. TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before
any test module imports workers.triton_ops.* (pytest imports this file first)."""

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    from workers import triton_ops

    if triton_ops.available():
        return
    skip = pytest.mark.skip(reason="the triton package is not installed")
    for item in items:
        if "tests/workers/triton" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
