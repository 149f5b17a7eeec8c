"""The KV offload options: launcher flags -> EngineConfig fields, and the option
combinations config_error refuses before anything starts."""

from __future__ import annotations

import argparse

import pytest

from launch.args import add_engine_args, engine_options
from protocol.config import EngineConfig, config_error


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return EngineConfig(**engine_options(p.parse_args(list(argv))))


def test_defaults_are_off() -> None:
    cfg = parse()
    assert (cfg.kv_offload_memory, cfg.kv_offload_disk, cfg.kv_offload_disk_size) == (0, None, 0)
    assert config_error(cfg) is None


def test_flags_map_to_fields_with_sizes_parsed() -> None:
    cfg = parse("--kv-offload-memory", "16G", "--kv-offload-disk", "kvdir",
                "--kv-offload-disk-size", "1.5GiB")
    assert cfg.kv_offload_memory == 16 * 2**30
    assert cfg.kv_offload_disk == "kvdir"
    assert cfg.kv_offload_disk_size == int(1.5 * 2**30)
    assert config_error(cfg) is None
    assert config_error(parse("--kv-offload-memory", "512M")) is None


def test_bad_size_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        parse("--kv-offload-memory", "lots")


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(kv_offload_memory=-1), "kv_offload_memory must be >= 0"),
        (dict(kv_offload_memory=2**30, kv_offload_disk_size=-5), "kv_offload_disk_size must"),
        (dict(kv_offload_memory=2**30, kv_offload_disk_size=2**30), "needs a directory"),
        (dict(kv_offload_memory=2**30, kv_offload_disk="d"), "needs a size"),
        (dict(kv_offload_memory=2**30, kv_offload_disk=""), "empty path"),
        (dict(kv_offload_disk="d", kv_offload_disk_size=2**30), "needs a host tier"),
        (dict(kv_offload_memory=2**30, enable_prefix_caching=False), "prefix caching"),
    ],
)
def test_config_errors(options: dict, match: str) -> None:
    err = config_error(EngineConfig(**options))
    assert err is not None and match in err
