"""Hostile adapters through the whole engine (engine core process, a real worker rank): while
an adapter's read is held in flight on the rank, another stream keeps getting tokens step by
step (counted, not timed); an oversized (sparse) file and NaN / inf weights are refused naming
the limit or the tensor; the engine then serves a good adapter."""

from __future__ import annotations

import queue
import shutil
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from launch import LLM, LoRARequest, SamplingParams
from tests.helpers.procs import wait_no_descendants
from workers.lora.manager import LOAD_GATE_ENV

pytestmark = pytest.mark.timeout(300)


def _poison(src: str, dst: Path, value: float) -> str:
    shutil.copytree(src, dst)
    file = str(dst / "adapter_model.safetensors")
    tensors = load_file(file)
    name = sorted(n for n in tensors if "lora_A" in n)[0]
    tensors[name][0, 0] = value
    save_file(tensors, file)
    return name


@pytest.mark.slow  # an engine core and a worker rank
def test_hostile_adapters_never_stall_or_break_other_streams(lora_world, tmp_path, monkeypatch
                                                             ) -> None:
    gate = tmp_path / "gate"
    monkeypatch.setenv(LOAD_GATE_ENV, str(gate))  # the rank inherits it
    big = tmp_path / "big"
    shutil.copytree(lora_world.adapters[0], big)
    with open(big / "adapter_model.safetensors", "r+b") as f:
        f.truncate(64 << 20)  # sparse: costs no disk
    llm = LLM(lora_world.base, enable_lora=True, dtype="float32", max_lora_rank=32,
              load_tokenizer=False, startup_timeout_s=120)
    try:
        assert llm.client is not None
        got: queue.Queue = queue.Queue()
        stream = llm.client.add_request("other", [5, 6, 7], SamplingParams(
            max_tokens=100_000, temperature=1.0, ignore_eos=True, logprobs=True), got)

        def tokens_until(n: int) -> int:
            seen = 0
            while seen < n:
                for _tracked, out, _t in got.get(timeout=60):  # the client's delivery
                    assert out.finish_reason is None, out.error
                    seen += len(out.new_token_ids)
            return seen

        tokens_until(1)
        errors: list[str] = []

        def load() -> None:
            try:
                llm.add_lora(LoRARequest("big", 5, str(big)), timeout_s=120)
            except ValueError as e:
                errors.append(str(e))

        loader = threading.Thread(target=load)
        loader.start()
        # the rank's read is held at the gate: the other stream's steps go on meanwhile
        assert tokens_until(20) >= 20
        assert loader.is_alive()
        gate.touch()
        loader.join(120)
        assert not loader.is_alive()
        assert len(errors) == 1 and "more than the" in errors[0] and "--max-lora-rank" in errors[0]
        for value, tag in ((float("nan"), "nan"), (float("inf"), "inf")):
            name = _poison(lora_world.adapters[0], tmp_path / tag, value)
            with pytest.raises(ValueError, match=f"{name} holds non-finite"):
                llm.add_lora(LoRARequest(tag, 6 if tag == "nan" else 7, str(tmp_path / tag)),
                             timeout_s=120)
        assert tokens_until(5) >= 5  # the other stream was never touched
        llm.add_lora(LoRARequest("good", 8, lora_world.adapters[0]), timeout_s=120)
        outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0),
                            lora_request=LoRARequest("good", 8, lora_world.adapters[0]),
                            use_tqdm=False, timeout_s=120)
        assert outs[0].finish_reason == "length", outs[0].error
        llm.client.abort([stream.request_id])
    finally:
        llm.shutdown()
    assert not wait_no_descendants(10.0), "a process outlived the test"
