"""The image flags of the launcher and the server (vLLM's names where vLLM has them)."""

from __future__ import annotations

import argparse
from typing import Any

from launch.args import parse_bytes
from launch.multimodal.options import MM_OPTION_NAMES, parse_json_dict, parse_limit_mm

__all__ = ["add_multimodal_args", "multimodal_kwargs"]


def _limit(text: str) -> dict[str, int]:
    try:
        return parse_limit_mm(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kwargs(text: str) -> dict[str, Any]:
    try:
        return parse_json_dict(text, "mm_processor_kwargs")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_multimodal_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("image inputs (vLLM's flags)")
    g.add_argument("--limit-mm-per-prompt", type=_limit, default=None, metavar="JSON",
                   help='most items per prompt, e.g. \'{"image": 4}\' (default 999); more is '
                   "a 400")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let image_url parts read file:// URLs below DIR (symlinks resolved); "
                   "off by default")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts http(s) image URLs may name (default: any)")
    g.add_argument("--mm-processor-kwargs", type=_kwargs, default=None, metavar="JSON",
                   help='image processor overrides: \'{"min_pixels": ..., "max_pixels": ...}\'')
    g.add_argument("--media-fetch-timeout", type=float, default=None, metavar="SECONDS",
                   help="whole-fetch limit for an http(s) image (default: "
                   "$VLLM_IMAGE_FETCH_TIMEOUT or 5)")
    g.add_argument("--media-max-bytes", type=parse_bytes, default=None, metavar="SIZE",
                   help="largest encoded image from any source (default 20M)")
    g.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                   help="largest image in pixels (width * height), refused before decoding "
                   "(default 89478485, PIL's bound)")


def multimodal_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The image options found in parsed args (unset flags left out): LLM()'s keywords."""
    return {k: v for k, v in vars(args).items() if k in MM_OPTION_NAMES and v is not None}
