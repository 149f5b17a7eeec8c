"""Session-wide set-up that must come before any test module is imported, and fixtures shared
across the test packages.

Without a GPU the Triton kernels run on CPU tensors under the Triton interpreter. Triton reads
TRITON_INTERPRET when a function is decorated, its own standard library (tl.zeros, ...)
included, and that happens the first time anything imports triton: not only our kernels, but
also libraries the tests import (peft pulls it in through transformers). So it is set here, in
the first conftest pytest loads, rather than beside the Triton tests: a kernel decorated for the
interpreter that calls a library function decorated without it fails with "Cannot call
@triton.jit'd outside of the scope of a kernel"."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `--dtype auto` on a CPU with native bf16 may pick bfloat16 (workers/cpu_dtype.py); the
# suite's references are float32, so it pins auto to float32 (tests of the choice itself
# clear this)
os.environ.setdefault("TANDEM_CPU_AUTO_DTYPE", "float32")


@pytest.fixture(scope="session")
def lora_world(tmp_path_factory):
    """A tiny HF Llama with three PEFT adapters and peft's tokens for them
    (tests/helpers/lora.py): one per session, so the runner tests (both kernel paths) and the
    engine's end-to-end tests pay for each peft reference once."""
    pytest.importorskip("peft")
    from tests.helpers.lora import LoRAWorld

    return LoRAWorld(str(tmp_path_factory.mktemp("lora_world")))
