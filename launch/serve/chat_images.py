"""The images of a chat request: image_url parts fetched, checked and processed into the
prompt's expanded token ids and one MMItem per image (launch/multimodal/).

The count is checked before anything is fetched (a text-only model, or more images than
``--limit-mm-per-prompt``, is a 400 at once); fetching runs in threads with the media limits;
decoding and resizing are CPU work for a thread too. Every failure is a 400 on ``messages``
whose message says what was wrong, never a path or a traceback.
"""

from __future__ import annotations

import asyncio
from typing import Any

from launch.multimodal.errors import ImageError
from launch.multimodal.media import fetch_image_url
from launch.serve.context import ServerContext
from launch.serve.errors import bad_request
from launch.serve.schemas import ChatMessage
from protocol.multimodal import MMItem

__all__ = ["fetch_chat_images", "image_urls", "with_images"]


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The image_url parts' URLs in prompt order (the order the template writes them)."""
    return [part.image_url.url
            for m in messages if isinstance(m.content, list)
            for part in m.content if part.type == "image_url" and part.image_url is not None]


async def fetch_chat_images(ctx: ServerContext, messages: list[ChatMessage]) -> list[bytes]:
    """The encoded images of the messages' image_url parts, fetched concurrently."""
    urls = image_urls(messages)
    if not urls:
        return []
    inputs = ctx.image_inputs
    try:
        inputs.check_count(len(urls))
        return list(await asyncio.gather(
            *(fetch_image_url(url, inputs.options) for url in urls)))
    except ImageError as e:
        raise bad_request(str(e), "messages") from None


def with_images(ctx: ServerContext, ids: list[int], images: list[Any]
                ) -> tuple[list[int], list[MMItem]]:
    """The templated prompt's ids with its image placeholders expanded, and the items.
    Blocking (decoding, resizing): call it from a worker thread."""
    if not images:
        return ids, []
    try:
        ids, items = ctx.image_inputs.items(ids, images)
        return ids, items
    except ImageError as e:
        raise bad_request(str(e), "messages") from None
