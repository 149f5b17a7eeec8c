"""`--dtype auto` on CPU: bfloat16 only for a bf16 checkpoint on a CPU with native bf16 that
measures it faster; float32 elsewhere."""

from __future__ import annotations

import pytest

from workers import cpu_dtype


@pytest.fixture(autouse=True)
def unpinned(monkeypatch):
    monkeypatch.delenv("TANDEM_CPU_AUTO_DTYPE", raising=False)


def test_float32_checkpoints_stay_float32(monkeypatch) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_model_and_flags", lambda: ("x", ["avx512_bf16"]))
    assert cpu_dtype.choose_cpu_dtype("float32", 256)[0] == "float32"
    assert cpu_dtype.choose_cpu_dtype(None, 256)[0] == "float32"


def test_no_native_bf16_means_float32(monkeypatch) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_model_and_flags", lambda: ("AVX2 box", ["avx2"]))
    dtype, why = cpu_dtype.choose_cpu_dtype("bfloat16", 256)
    assert dtype == "float32" and "no native bf16" in why


@pytest.mark.parametrize(("speedup", "want"), [(1.9, "bfloat16"), (1.05, "float32")])
def test_native_bf16_follows_the_probe(monkeypatch, speedup: float, want: str) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_model_and_flags", lambda: ("x", ["amx_bf16"]))
    monkeypatch.setattr(cpu_dtype, "bf16_speedup", lambda hidden: speedup)
    assert cpu_dtype.choose_cpu_dtype("bfloat16", 256)[0] == want


def test_the_override_wins(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_AUTO_DTYPE", "bfloat16")
    assert cpu_dtype.choose_cpu_dtype("float32", 256) == ("bfloat16", "TANDEM_CPU_AUTO_DTYPE")


def test_the_probe_measures_this_machine() -> None:
    assert cpu_dtype.bf16_speedup(256, reps=2) > 0
    model, flags = cpu_dtype.cpu_model_and_flags()
    assert isinstance(model, str) and isinstance(flags, list)
