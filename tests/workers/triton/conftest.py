"""The Triton kernels run on a GPU where there is one, else on CPU tensors under the Triton
interpreter (TRITON_INTERPRET is set for the whole session by tests/conftest.py, before anything
imports triton)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    from workers import triton_ops

    if triton_ops.available():
        return
    skip = pytest.mark.skip(reason="the triton package is not installed")
    for item in items:
        if "tests/workers/triton" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
