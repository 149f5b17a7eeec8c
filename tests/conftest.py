"""Session-wide set-up that must come before any test module is imported.

Without a GPU the Triton kernels run on CPU tensors under the Triton interpreter. Triton reads
TRITON_INTERPRET when a function is decorated, its own standard library (tl.zeros, ...)
included, and that happens the first time anything imports triton: not only our kernels, but
also libraries the tests import (peft pulls it in through transformers). So it is set here, in
the first conftest pytest loads, rather than beside the Triton tests: a kernel decorated for the
interpreter that calls a library function decorated without it fails with "Cannot call
@triton.jit'd outside of the scope of a kernel"."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
