"""Make the repository root importable (workers/, protocol/, tests.helpers) without installing;
fixtures shared by the worker tests."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def lora_world(tmp_path_factory):
    """A tiny HF Llama with three PEFT adapters and peft's tokens for them
    (tests/helpers/lora.py), shared by the LoRA runner tests of both kernel paths."""
    pytest.importorskip("peft")
    from tests.helpers.lora import LoRAWorld

    return LoRAWorld(str(tmp_path_factory.mktemp("lora_world")))
