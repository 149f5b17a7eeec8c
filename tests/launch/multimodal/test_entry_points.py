"""The image flags parse as vLLM's; LLM.generate takes dict prompts (slow: starts an engine)."""

from __future__ import annotations

import pytest

from launch.multimodal.args import multimodal_kwargs
from launch.multimodal.options import MultiModalOptions


def test_serve_flags() -> None:
    pytest.importorskip("fastapi")
    from launch.serve.args import build_parser

    args = build_parser().parse_args([
        "--limit-mm-per-prompt", '{"image": 2}', "--mm-processor-kwargs",
        '{"max_pixels": 100352}', "--media-fetch-timeout", "3", "--media-max-bytes", "1M"])
    kw = multimodal_kwargs(args)
    opts = MultiModalOptions.from_kwargs(kw)
    assert opts.image_limit() == 2 and opts.media_fetch_timeout == 3.0
    assert opts.media_max_bytes == 2**20 and opts.mm_processor_kwargs == {"max_pixels": 100352}
    assert multimodal_kwargs(build_parser().parse_args([])) == {}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--limit-mm-per-prompt", '{"video": 1}'])


@pytest.mark.slow
def test_llm_dict_prompts_on_a_text_model() -> None:
    from PIL import Image

    from launch import LLM, SamplingParams

    with LLM("dummy:tiny", limit_mm_per_prompt={"image": 2}) as llm:
        sp = SamplingParams(max_tokens=2, temperature=0.0)
        plain = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0]
        same = llm.generate({"prompt_token_ids": [1, 2, 3]}, sp, use_tqdm=False)[0]
        assert same.token_ids == plain.token_ids
        with pytest.raises(ValueError, match="does not accept images"):
            llm.generate({"prompt_token_ids": [1, 2, 3],
                          "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}, sp)
