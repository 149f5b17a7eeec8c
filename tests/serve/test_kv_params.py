"""kv_transfer_params where they enter the HTTP server: a value out of bounds is a 400 naming
the field (no engine needed)."""

from __future__ import annotations

import pytest

from launch.serve.errors import APIError
from launch.serve.kv_params import request_kv_params

GOOD = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
        "remote_port": 9000, "remote_rank_ports": [9001], "tp_size": 1,
        "remote_request_id": "k", "remote_block_ids": [1, 2], "remote_num_tokens": 20}


@pytest.mark.parametrize(("field", "value"), [
    ("remote_block_ids", list(range(1, 100))),  # more than max_model_len's blocks
    ("remote_port", 65536),
    ("remote_rank_ports", [1] * 65),
    ("remote_host", "h" * 254),
    ("remote_request_id", "k" * 257),
    ("remote_lease_s", -3.0),
])
def test_out_of_bounds_is_a_400_naming_the_field(field: str, value: object) -> None:
    assert request_kv_params(GOOD, 1, max_blocks=64) is not None
    with pytest.raises(APIError) as info:
        request_kv_params({**GOOD, field: value}, 1, max_blocks=64)
    assert info.value.status == 400 and info.value.param == f"kv_transfer_params.{field}"


# what vllm-router sends a prefill server (its NixlConnector P/D flow): nulls for what is not
# known yet, and keys this engine does not use
ROUTER_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_nulls_are_not_known_yet_and_unknown_keys_are_ignored() -> None:
    p = request_kv_params(ROUTER_PREFILL | {"some_future_key": [1, {"x": None}]}, 1)
    assert p is not None and p.do_remote_decode and not p.do_remote_prefill
    assert p.remote_engine_id == "" and p.remote_block_ids == [] and p.remote_port == 0
    # all null: an ordinary request
    assert request_kv_params(dict.fromkeys(ROUTER_PREFILL), 1) is None


@pytest.mark.parametrize(("field", "value"), [
    ("remote_port", "9000"),  # vLLM's types: remote_port int, ids list[int], strings str
    ("remote_block_ids", ["1"]),
    ("remote_engine_id", 7),
    ("remote_host", ["h"]),
    ("tp_size", 1.5),
])
def test_types_stay_strict(field: str, value: object) -> None:
    with pytest.raises(APIError) as info:
        request_kv_params({**GOOD, field: value}, 1, max_blocks=64)
    assert info.value.status == 400 and field in info.value.message
