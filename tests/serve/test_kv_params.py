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
