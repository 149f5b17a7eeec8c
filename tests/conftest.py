"""Fixtures shared across the test packages."""

import pytest


@pytest.fixture(scope="session")
def lora_world(tmp_path_factory):
    """A tiny HF Llama with three PEFT adapters and peft's tokens for them
    (tests/helpers/lora.py): one per session, so the runner tests (both kernel paths) and the
    engine's end-to-end tests pay for each peft reference once."""
    pytest.importorskip("peft")
    from tests.helpers.lora import LoRAWorld

    return LoRAWorld(str(tmp_path_factory.mktemp("lora_world")))
