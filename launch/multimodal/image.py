"""What a client may send as an image, decoded and checked, as an RGB uint8 array [H, W, 3].

Accepted, as vLLM and transformers take them:
- a PIL.Image.Image of any mode; alpha (RGBA, LA, P with transparency) is composited onto white,
  as transformers' convert_to_rgb does;
- a numpy array, channels last: [H, W] gray, [H, W, 1], [H, W, 3] RGB or [H, W, 4] RGBA; uint8
  (or another integer type with values in [0, 255]), or floating point in [0, 1], which is scaled
  by 255 and truncated to uint8 (what transformers' to_pil_image does before its PIL resize);
- bytes of an encoded image in any format Pillow reads (PNG, JPEG, WebP, GIF: the first frame).

Images are hostile input: an image larger than ``max_pixels`` is refused from its header, before
its pixels are decoded (a small file can declare a huge image: a decompression bomb), and
anything that fails to decode is an ImageError with the reason, never a path or a traceback.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
from PIL import Image

from launch.multimodal.errors import ImageError
from launch.multimodal.options import DEFAULT_MAX_IMAGE_PIXELS

__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "ImageError", "check_size", "decode_image", "to_rgb"]



def check_size(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"image has no pixels ({width} x {height})")
    if width * height > max_pixels:
        raise ImageError(f"image of {width} x {height} = {width * height} pixels is over the "
                         f"limit of {max_pixels} pixels")


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Encoded bytes as a loaded PIL image; ImageError when corrupt, empty or too large."""
    if not data:
        raise ImageError("image data is empty")
    try:
        with warnings.catch_warnings():
            # our own limit is checked below; PIL's bomb warning would only be noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))  # reads the header only
            check_size(img.width, img.height, max_pixels)
            img.load()
    except ImageError:
        raise
    except Image.DecompressionBombError:
        # PIL's own bound (twice Image.MAX_IMAGE_PIXELS), checked in open() itself: it stays
        # in force (it is process-wide, not ours to lift), so a higher max_pixels cannot pass it
        raise ImageError(f"image is over the limit of {min(max_pixels, _pil_bound())} "
                         "pixels") from None
    except Exception as e:  # noqa: BLE001 - every decoder failure is a bad image
        raise ImageError(f"cannot decode image: {_reason(e)}") from None
    return img


def _pil_bound() -> int:
    bound = Image.MAX_IMAGE_PIXELS
    return 2 * bound if bound else 2**63


def _reason(e: Exception) -> str:
    # PIL's messages say what is wrong ("cannot identify image file", "image file is
    # truncated"); the repr of the BytesIO it may quote says nothing to a client
    text = str(e).split(" <_io.BytesIO", 1)[0].strip()
    return text or type(e).__name__


def to_rgb(image: Any, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Any accepted image (see the module's docstring) as uint8 RGB [H, W, 3]."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = decode_image(bytes(image), max_pixels)
    if isinstance(image, Image.Image):
        check_size(image.width, image.height, max_pixels)
        return _pil_rgb(image)
    if isinstance(image, np.ndarray):
        return _array_rgb(image, max_pixels)
    raise ImageError(f"unsupported image type {type(image).__name__}: expected a PIL image, "
                     "a numpy array or encoded image bytes")


def _pil_rgb(img: Image.Image) -> np.ndarray:
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", img.size, (255, 255, 255, 255))
            rgb = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            rgb = img.convert("RGB")
        out = np.asarray(rgb, dtype=np.uint8)
    except Exception as e:  # noqa: BLE001 - a lazily loaded image can fail only now
        raise ImageError(f"cannot decode image: {_reason(e)}") from None
    return np.ascontiguousarray(out)


def _array_rgb(a: np.ndarray, max_pixels: int) -> np.ndarray:
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        raise ImageError(f"image array of shape {a.shape}: expected [H, W], [H, W, 1], "
                         "[H, W, 3] or [H, W, 4] (channels last)")
    check_size(a.shape[1], a.shape[0], max_pixels)
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all() or a.min() < 0.0 or a.max() > 1.0:
            raise ImageError("a floating-point image array must hold values in [0, 1]")
        if a.shape[2] == 4:  # transformers' convert_to_rgb: blend onto white, in float
            alpha = a[..., 3:4]
            a = (alpha * a[..., :3] + (1 - alpha) * 1.0).astype(a.dtype)
        a = (a.astype(np.float64) * 255).astype(np.uint8)
    elif np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
        if a.dtype != np.uint8:
            if a.size and (a.min() < 0 or a.max() > 255):
                raise ImageError("an integer image array must hold values in [0, 255]")
            a = a.astype(np.uint8)
        if a.shape[2] == 4:  # transformers' convert_to_rgb for uint8: round the blend
            alpha = a[..., 3:4] / 255
            a = np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    else:
        raise ImageError(f"image array of dtype {a.dtype}: expected uint8 or float in [0, 1]")
    if a.shape[2] == 1:
        a = np.repeat(a, 3, axis=2)
    return np.ascontiguousarray(a)
