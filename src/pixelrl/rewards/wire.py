"""The reward server's wire format: JSON only, never pickle.

Request (POST /score, Content-Type: application/json):
    {"protocol": 1, "prompts": [str, ...], "metadata": [{...}, ...],
     "images": {"encoding": "png", "data": [base64 PNG, ...]}}
  or "images": {"encoding": "raw", "shape": [B, H, W, 3], "data": base64 of B*H*W*3 uint8 bytes}
  and, for a reward that reads each edit's source images, "sources": [[base64 PNG, ...], ...]
  (row i's sources, one or more each).
Answer 200: {"scores": {"<key>": [float, ...], ...}}; any other status: {"error": "<message>"}.

Everything a request carries is data: strings, numbers and pixels. Decoding checks sizes before
it allocates, so a hostile request costs at most the server's limits.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from pixelrl.core.errors import PixelRLError

PROTOCOL = 1
ENCODINGS = ("png", "raw")


class WireError(PixelRLError):
    """A request or answer that breaks the wire format; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    max_images: int = 1024
    max_pixels: int = 4096 * 4096  # per image
    # decoded pixels of one request in all, checked from the PNG headers before anything is
    # decoded: 64 Mpx is 192 MB of RGB, where 1,024 images of 16 Mpx would ask for 48 GB
    max_total_pixels: int = 64 * 1024 * 1024


def _json_value(value):
    """Metadata values numpy produced become plain JSON values; anything else is refused."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON data")


class Request(NamedTuple):
    images: np.ndarray  # [B, H, W, 3] uint8
    prompts: list[str]
    metadata: list[dict]
    sources: list[tuple[np.ndarray, ...]] | None  # row i's source images, when the request sent them


def _png_text(array) -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array, dtype=np.uint8), mode="RGB").save(buffer, format="PNG",
                                                                                  compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_request(images: np.ndarray, prompts: list[str], metadata: list[dict], encoding: str = "png",
                   sources: list | None = None) -> bytes:
    """The request body; `sources` (row i's tuple of uint8 [H, W, 3] source images) travel as PNG
    whatever `encoding` the generated images take."""
    images = np.ascontiguousarray(images, dtype=np.uint8)
    if encoding == "png":
        payload = {"encoding": "png", "data": [_png_text(array) for array in images]}
    else:
        payload = {"encoding": "raw", "shape": list(images.shape), "data": base64.b64encode(images.tobytes()).decode("ascii")}
    body = {"protocol": PROTOCOL, "prompts": list(prompts), "metadata": list(metadata), "images": payload}
    if sources is not None:
        body["sources"] = [[_png_text(np.asarray(source)) for source in row] for row in sources]
    try:
        return json.dumps(body, default=_json_value).encode("utf-8")
    except TypeError as err:
        raise WireError(f"metadata cannot be sent to a reward server: {err}; keep metadata to strings, numbers, "
                        "lists and dicts") from None


def _b64(text, what: str) -> bytes:
    if not isinstance(text, str):
        raise WireError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise WireError(f"{what} is not valid base64") from None


def _open_png(text, where: str, limits: Limits):
    """The PNG at `where` (e.g. images.data[3]), opened lazily (its header only), after the
    per-image size check."""
    raw = _b64(text, where)
    try:
        image = Image.open(io.BytesIO(raw), formats=["PNG"])  # lazy: reads the header only
    except Exception:
        raise WireError(f"{where} is not a PNG image") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise WireError(f"{where} is {width}x{height}, over this server's {limits.max_pixels} pixels", status=413)
    return image


def _decode_png(image, where: str) -> np.ndarray:
    try:
        return np.array(image.convert("RGB"), dtype=np.uint8)  # writable: torch takes it as it is
    except Exception:
        raise WireError(f"{where} is a damaged PNG image") from None


def _open_sources(rows, batch: int, limits: Limits) -> list[list]:
    """The `sources` field: one non-empty list of PNGs per prompt, opened lazily (headers only)."""
    if not isinstance(rows, list) or len(rows) != batch or not all(isinstance(r, list) and r for r in rows):
        raise WireError(f"sources must be a list of {batch} non-empty lists of base64 PNG images, one per prompt")
    if sum(len(r) for r in rows) > limits.max_images:
        raise WireError(f"{sum(len(r) for r in rows)} source images in one request, over this server's "
                        f"{limits.max_images}; send smaller batches (the remote reward's batch_size)", status=413)
    return [[_open_png(text, f"sources[{i}][{j}]", limits) for j, text in enumerate(row)] for i, row in enumerate(rows)]


def _check_total_pixels(total: int, limits: Limits) -> None:
    if total > limits.max_total_pixels:
        raise WireError(f"the request's images hold {total} pixels in all, over this server's "
                        f"{limits.max_total_pixels}; send fewer or smaller images per request (the remote reward's "
                        "batch_size)", status=413)


def decode_request(body: bytes, limits: Limits = Limits()) -> Request:
    """The images [B, H, W, 3] uint8, prompts, metadata and sources of a request body, or a WireError."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("the body is not JSON (this server takes JSON only; pickled payloads are refused)") from None
    except RecursionError:
        raise WireError("the JSON is nested too deeply to read; send flat metadata") from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise WireError(f"the JSON holds a value this server does not read ({err})") from None
    if not isinstance(request, dict):
        raise WireError("the body must be a JSON object with protocol, prompts, metadata and images")
    if request.get("protocol") != PROTOCOL:
        raise WireError(f"protocol {request.get('protocol')!r} is not supported; this server speaks protocol {PROTOCOL}")
    prompts, metadata, images = request.get("prompts"), request.get("metadata"), request.get("images")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
        raise WireError("prompts must be a non-empty list of strings")
    batch = len(prompts)
    if batch > limits.max_images:
        raise WireError(f"{batch} images in one request, over this server's {limits.max_images}; send smaller "
                        "batches (the remote reward's batch_size)", status=413)
    if not isinstance(metadata, list) or len(metadata) != batch or not all(isinstance(m, dict) for m in metadata):
        raise WireError(f"metadata must be a list of {batch} objects, one per prompt")
    if not isinstance(images, dict) or images.get("encoding") not in ENCODINGS:
        raise WireError(f"images must be an object with encoding one of {list(ENCODINGS)}")
    sources = None if request.get("sources") is None else _open_sources(request["sources"], batch, limits)
    source_pixels = sum(image.size[0] * image.size[1] for row in sources or () for image in row)
    if images["encoding"] == "png":
        data = images.get("data")
        if not isinstance(data, list) or len(data) != batch:
            raise WireError(f"images.data must be a list of {batch} base64 PNG images, one per prompt")
        opened = [_open_png(text, f"images.data[{i}]", limits) for i, text in enumerate(data)]
        _check_total_pixels(sum(image.size[0] * image.size[1] for image in opened) + source_pixels, limits)
        arrays = [_decode_png(image, f"images.data[{i}]") for i, image in enumerate(opened)]
        if len({a.shape for a in arrays}) != 1:
            raise WireError(f"images differ in size {sorted({a.shape for a in arrays})}; send one size per request")
        decoded = np.stack(arrays)
    else:
        shape = images.get("shape")
        if (not isinstance(shape, list) or len(shape) != 4 or not all(isinstance(s, int) and s > 0 for s in shape)
                or shape[0] != batch or shape[3] != 3):
            raise WireError(f"images.shape must be [{batch}, H, W, 3] with positive integers, got {shape!r}")
        if shape[1] * shape[2] > limits.max_pixels:
            raise WireError(f"images are {shape[2]}x{shape[1]}, over this server's {limits.max_pixels} pixels",
                            status=413)
        _check_total_pixels(batch * shape[1] * shape[2] + source_pixels, limits)
        raw = _b64(images.get("data"), "images.data")
        if len(raw) != batch * shape[1] * shape[2] * 3:
            raise WireError(f"images.data holds {len(raw)} bytes; shape {shape} needs {batch * shape[1] * shape[2] * 3}")
        decoded = np.frombuffer(raw, dtype=np.uint8).reshape(shape).copy()
    if sources is not None:
        sources = [tuple(_decode_png(image, f"sources[{i}][{j}]") for j, image in enumerate(row))
                   for i, row in enumerate(sources)]
    return Request(decoded, prompts, metadata, sources)


def encode_scores(scores: dict[str, torch.Tensor]) -> bytes:
    return json.dumps({"scores": {k: v.tolist() for k, v in scores.items()}}).encode("utf-8")


def decode_scores(body: bytes, batch: int) -> dict[str, torch.Tensor]:
    try:
        answer = json.loads(body)
        scores = answer["scores"]
        out = {str(k): torch.tensor([float(x) for x in v], dtype=torch.float32) for k, v in scores.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise WireError(f"the server's answer is not a scores object: {body[:200]!r}") from None
    if not out or any(len(v) != batch for v in out.values()):
        raise WireError(f"the server answered {({k: len(v) for k, v in out.items()})} scores for {batch} images")
    return out
