"""Images in API requests: OpenAI ``image_url`` parts and Anthropic ``image`` blocks, inline only.

A route turns each image part of a user turn into an :class:`ImagePart` (its bytes, the media
type it declares, the request field it came from); :func:`prepare` then decodes and preprocesses
every image of the conversation, in order, into the engine's :class:`~jaxmoe.inference.Images`,
and leaves ``{"type": "image", "tokens": n}`` parts in the messages for the chat template. Every
refusal is a 400 naming the field: a remote URL (this server never fetches), bad base64, a media
type outside :data:`MEDIA_TYPES`, data that is not the declared type, or an image over a limit
(:class:`~jaxmoe.vision.preprocess.ImageLimits`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re

import numpy as np
from PIL import Image, UnidentifiedImageError

from jaxmoe.config import VisionConfig
from jaxmoe.inference.scheduler import Images
from jaxmoe.serve.errors import bad_request
from jaxmoe.vision.layout import merged_tokens
from jaxmoe.vision.preprocess import ImageError, ImageLimits, preprocess

# The media types both APIs document, and Pillow's name of each format.
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)
_REMOTE = "this server does not fetch remote images; send the image inline"


@dataclasses.dataclass(frozen=True)
class ImagePart:
    """One image of a request, not yet decoded."""

    data: bytes
    media_type: str
    field: str  # where it came from, e.g. messages[0].content[1]


def _media_type(media_type, field: str) -> str:
    if media_type not in MEDIA_TYPES:
        raise bad_request(f"{field}: unsupported media type {media_type!r}; allowed: {', '.join(MEDIA_TYPES)}", field)
    return media_type


def _base64(text, field: str) -> bytes:
    if not isinstance(text, str) or not text:
        raise bad_request(f"{field}: must be a non-empty base64 string", field)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{field}: not valid base64 ({e})", field) from None


def openai_image(part: dict, field: str) -> ImagePart:
    """An ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` part."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    where = f"{field}.image_url.url"
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: required, a data: URL (data:image/png;base64,...)", where)
    if isinstance(image_url, dict) and image_url.get("detail", "auto") not in ("auto", "low", "high"):
        raise bad_request(f"{field}.image_url.detail: must be auto, low or high", f"{field}.image_url.detail")
    if re.match(r"(?i)(https?|ftp|file)://", url):
        raise bad_request(f"{where}: remote image URLs are refused: {_REMOTE} as a data: URL", where)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise bad_request(f"{where}: must be a base64 data: URL (data:image/png;base64,...), got {url[:40]!r}", where)
    media_type = _media_type(match["type"], where)
    return ImagePart(_base64(match["data"], where), media_type, field)


def anthropic_image(block: dict, field: str) -> ImagePart:
    """An ``{"type": "image", "source": {"type": "base64", "media_type", "data"}}`` block."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":
        raise bad_request(f"{field}.source: remote image URLs are refused: {_REMOTE} as a base64 source", field)
    if kind != "base64":
        raise bad_request(f"{field}.source.type: must be base64 (url and file sources are not supported)", field)
    media_type = _media_type(source.get("media_type"), f"{field}.source.media_type")
    return ImagePart(_base64(source.get("data"), f"{field}.source.data"), media_type, field)


def prepare(
    messages: list[dict], vision: VisionConfig | None, limits: ImageLimits
) -> tuple[list[dict], Images | None, int]:
    """``(messages, images, image tokens)``: every :class:`ImagePart` decoded, preprocessed and
    replaced by ``{"type": "image", "tokens": n}``; without image parts, the messages as they are.

    Raises:
      APIError: 400 naming the image's field (a model without a vision tower, too many images,
        undecodable data, a format other than the declared one, an image over a limit).
    """
    parts = [
        p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if isinstance(p, ImagePart)
    ]
    if not parts:
        return messages, None, 0
    if vision is None:
        raise bad_request(f"{parts[0].field}: this model takes no image input (it has no vision tower)", parts[0].field)
    if len(parts) > limits.max_images:
        field = parts[limits.max_images].field
        raise bad_request(
            f"{field}: the conversation holds {len(parts)} images; the limit is {limits.max_images} a request", field
        )
    pixels, grids, tokens = [], [], {}
    for part in parts:
        _check_format(part)
        try:
            pv, grid = preprocess([part.data], vision, dataclasses.replace(limits, max_images=1))
        except ImageError as e:
            raise bad_request(f"{part.field}: {str(e).removeprefix('image 0: ')}", part.field) from None
        pixels.append(pv)
        grids.append(grid)
        tokens[id(part)] = merged_tokens([tuple(int(v) for v in grid[0, 1:])], vision)
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            content = [
                {"type": "image", "tokens": tokens[id(p)]} if isinstance(p, ImagePart) else p for p in m["content"]
            ]
            m = {**m, "content": content}
        out.append(m)
    return out, Images(np.concatenate(pixels), np.concatenate(grids)), sum(tokens.values())


def _check_format(part: ImagePart) -> None:
    """400 unless the bytes are an image of the declared media type (read from the header only)."""
    try:
        with Image.open(io.BytesIO(part.data)) as image:
            found = image.format
    except (UnidentifiedImageError, OSError, ValueError):
        raise bad_request(
            f"{part.field}: the data is not a readable image ({part.media_type} declared)", part.field
        ) from None
    if found != MEDIA_TYPES[part.media_type]:
        raise bad_request(
            f"{part.field}: the media type says {part.media_type} but the data is {found or 'of an unknown format'}",
            part.field,
        )
