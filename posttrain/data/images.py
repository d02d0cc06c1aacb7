"""Images of vision-language rows: loading image references, counting and normalising the image
placeholders of prompts. Every failure is a one-line DataError naming the location, the reference
(shortened) and the fix."""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlparse
from urllib.request import url2pathname

from PIL import Image, UnidentifiedImageError

from posttrain.config.data_sections import IMAGE_MAX_BYTES, IMAGE_MAX_PIXELS, IMAGE_URL_TIMEOUT

from .errors import DataError, where

IMAGE_TAG = "<image>"
IMAGE_PART_TYPES = ("image", "image_url", "input_image")  # "image_url"/"input_image": OpenAI style
TEXT_PART_TYPES = ("text", "input_text")

ACCEPTED = (
    "a file path (absolute, or relative to the current folder or the data file's folder), a file:// URI, "
    "an http(s) URL, a data:image/...;base64 URI, base64 text, image file bytes, a {'bytes', 'path'} dict "
    "(Hugging Face Image feature) or a PIL image"
)
_MAX_REF = 80
_B64_MIN = 64  # shorter strings that fail as paths are reported as missing files, not as bad base64


def _short(ref: Any, limit: int = _MAX_REF) -> str:
    """A repr of an image reference of at most about `limit` characters (never a whole base64 string)."""
    if isinstance(ref, Image.Image):
        return f"<PIL image {ref.mode} {ref.width}x{ref.height}>"
    if isinstance(ref, (bytes, bytearray)):
        head = repr(bytes(ref[:12]))
        return f"{head}... ({len(ref)} bytes)" if len(ref) > 12 else head
    if isinstance(ref, dict):
        return "{" + ", ".join(f"{k!r}: {_short(v, 30)}" for k, v in list(ref.items())[:3]) + "}"
    text = repr(ref)
    if len(text) <= limit:
        return text
    size = f" ({len(ref)} chars)" if isinstance(ref, str) else ""
    return text[: limit - 3 - len(size)] + "..." + size


def _fail(location: str, ref: Any, why: str, fix: str) -> DataError:
    return DataError(f"{location}: image {_short(ref)}: {why}. {fix}.")


_FIX_DATA = "Fix the image reference in the data"


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on reading one image reference: `max_bytes` read from a file, a download, a data: URI, base64
    text or a byte string (checked while reading, never more read); `max_pixels` (width x height) of the
    image, checked from its header before it is decoded; `url_timeout`, the seconds a URL may take in all
    (connection and download). Defaults: 64 MiB, PIL's 89,478,485 pixels, 10 s."""

    max_bytes: int = IMAGE_MAX_BYTES
    max_pixels: int = IMAGE_MAX_PIXELS
    url_timeout: float = IMAGE_URL_TIMEOUT

    @classmethod
    def of(cls, data_cfg) -> ImageLimits:
        """The limits a `--data` section sets (`--data.max_image_bytes`, `--data.max_image_pixels`,
        `--data.image_url_timeout`)."""
        return cls(data_cfg.max_image_bytes, data_cfg.max_image_pixels, data_cfg.image_url_timeout)

    def over_bytes(self, size: int | None = None) -> str:
        """Why an image of `size` bytes (when known) is refused: more than `max_bytes`."""
        known = f" ({size:,} bytes)" if size else ""
        return f"larger than --data.max_image_bytes {self.max_bytes:,}{known}"


DEFAULT_IMAGE_LIMITS = ImageLimits()  # the flags' defaults


def image_reading(data_cfg) -> dict:
    """The image keywords of the datasets (`SFTDataset`, `PreferenceDataset`, `PromptDataset`) that a `--data`
    section sets: the row's image column, the most images a prompt may carry, and `ImageLimits.of`."""
    return {"image_key": data_cfg.image_key, "max_images": max_images(data_cfg),
            "image_limits": ImageLimits.of(data_cfg)}


def max_images(data_cfg) -> int:
    """The most images a row or prompt may carry, as a trainer's `--data` section sets it (0: the run is text
    only; a section without image flags, KTO's, is text only)."""
    return data_cfg.max_images_per_prompt if hasattr(data_cfg, "max_images_per_prompt") else 0


def max_images_flag(value: object = None) -> str:
    """The flag that sets `max_images`, as messages name it (with `value` when given, e.g. 2 or "N")."""
    flag = "--data.max_images_per_prompt"
    return flag if value is None else f"{flag} {value}"


_FIX_BYTES = "Shrink or replace the image, or raise --data.max_image_bytes"
# PIL refuses an image above 2 x Image.MAX_IMAGE_PIXELS when it opens it (and warns above 1 x). posttrain
# checks --data.max_image_pixels itself from the header; only a limit above PIL's raises PIL's global to it,
# under this lock and for the header only (PIL's check stays on, at the higher limit)
_OPEN_LOCK = threading.Lock()
_PIL_PIXELS = re.compile(r"\((\d+) pixels\)")


def to_rgb(img: Image.Image) -> Image.Image:
    """`img` in RGB, as Hugging Face image processors' `convert_to_rgb` makes it: an image with transparency
    (an alpha band: RGBA, LA, PA, ...; or a transparent colour: a palette, L or RGB image with
    ``info["transparency"]``) is composited over white; any other mode is converted. Every image posttrain
    feeds a model or an engine passes through here once, so the processor's own conversion is a no-op."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def _pixels_error(img: Image.Image, limits: ImageLimits) -> str | None:
    """Why `img` is too large to decode (more pixels than `limits.max_pixels`), or None."""
    if img.width * img.height <= limits.max_pixels:
        return None
    return (f"too large: {img.width}x{img.height} = {img.width * img.height:,} pixels, more than "
            f"--data.max_image_pixels {limits.max_pixels:,} (raise it to read this image)")


def _try_decode(data: bytes, limits: ImageLimits) -> Image.Image | str:
    """The RGB image encoded in `data` (`to_rgb`), or why it is not one: larger than the limits (bytes, or
    pixels read from the header before decoding), or PIL's reason."""
    if not data:
        return "empty (0 bytes)"
    if len(data) > limits.max_bytes:
        return limits.over_bytes(len(data))
    try:
        img = _open(data, limits)
        if isinstance(img, str):
            return img
        with img:
            too_large = _pixels_error(img, limits)
            if too_large:
                return too_large
            img.load()
            return to_rgb(img)
    except UnidentifiedImageError:
        return "not an image (no format PIL can read)"
    except Image.DecompressionBombError as e:  # a frame or layer beyond PIL's own limit, found while decoding
        return f"too large (PIL: {_clip(e)})"
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ...
        return f"a corrupt or truncated image (PIL {type(e).__name__}: {_clip(e)})"


def _open(data: bytes, limits: ImageLimits) -> Image.Image | str:
    """`Image.open` of `data` (the header only), or why it is too large when PIL's own check refuses it."""
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the caller checks the pixels
            pil_limit = Image.MAX_IMAGE_PIXELS
            if pil_limit is None or limits.max_pixels <= pil_limit:
                return Image.open(io.BytesIO(data))
            Image.MAX_IMAGE_PIXELS = limits.max_pixels
            try:
                return Image.open(io.BytesIO(data))
            finally:
                Image.MAX_IMAGE_PIXELS = pil_limit
    except Image.DecompressionBombError as e:  # over twice the limit: PIL names the pixels, not the size
        found = _PIL_PIXELS.search(str(e))
        size = f"{int(found.group(1)):,} pixels" if found else f"PIL: {_clip(e)}"
        return (f"too large: {size}, more than --data.max_image_pixels {limits.max_pixels:,} (raise it to "
                "read this image)")


def _clip(e: Exception, limit: int = 80) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _decode(data: bytes, location: str, ref: Any, what: str, limits: ImageLimits) -> Image.Image:
    img = _try_decode(data, limits)
    if isinstance(img, str):
        raise _fail(location, ref, f"{what} is {img}", _FIX_DATA + " or replace the image")
    return img


def _from_pil(img: Image.Image, location: str, limits: ImageLimits) -> Image.Image:
    too_large = _pixels_error(img, limits)
    if too_large:
        raise _fail(location, img, f"the PIL image is {too_large}", _FIX_DATA + " or replace the image")
    try:
        img.load()
        return to_rgb(img)
    except Exception as e:
        raise _fail(location, img, f"the PIL image could not be loaded, it is corrupt or truncated "
                    f"(PIL {type(e).__name__}: {_clip(e)})", _FIX_DATA + " or replace the image") from None


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _from_file(path: str, location: str, ref: Any, limits: ImageLimits) -> Image.Image:
    """The image in the regular file `path`: a device, FIFO or socket is refused before it is opened (opening
    one may block, or act on the device; reading it may never end), checked again on the opened file (it may
    have been replaced in between), and at most `limits.max_bytes` + 1 bytes are read."""
    if os.path.isdir(path):
        raise _fail(location, ref, f"{path} is a folder, not an image file", _FIX_DATA)

    def regular(mode: int) -> None:
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise _fail(location, ref, f"{path} is {kind}, not a regular file; images are read from "
                        "regular files only", _FIX_DATA + " (copy the image into a file)")

    try:
        regular(os.stat(path).st_mode)
        # no blocking open (a FIFO swapped in since the stat), never a controlling terminal
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            regular(info.st_mode)
            size = info.st_size
            if size > limits.max_bytes:
                raise _fail(location, ref, f"file {path} is {limits.over_bytes(size)}", _FIX_BYTES)
            data = f.read(limits.max_bytes + 1)  # the file may have grown since
    except OSError as e:
        raise _fail(location, ref, f"{path} could not be read ({e.strerror or e})",
                    "Fix the file's permissions or the path in the data") from None
    return _decode(data, location, ref, f"file {path}", limits)


def _b64(text: str, limits: ImageLimits) -> bytes | str | None:
    """The bytes of base64 `text` (whitespace ignored; standard or URL-safe alphabet), None when it is not
    base64, or why not when it would decode to more than `limits.max_bytes` (checked before decoding)."""
    compact = "".join(text.split())
    if not compact or not re.fullmatch(r"[A-Za-z0-9+/]*={0,2}|[A-Za-z0-9_-]*={0,2}", compact):
        return None
    padded = compact + "=" * (-len(compact) % 4)
    size = len(padded) // 4 * 3 - (len(padded) - len(padded.rstrip("=")))
    if size > limits.max_bytes:
        return limits.over_bytes(size)
    try:
        return base64.b64decode(padded, altchars=b"-_" if "-" in compact or "_" in compact else None,
                                validate=True)
    except (binascii.Error, ValueError):
        return None


def _from_data_uri(ref: str, location: str, limits: ImageLimits) -> Image.Image:
    header, sep, payload = ref.partition(",")
    form = "data:image/<format>;base64,<data>"
    if not sep or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise _fail(location, ref, f"unsupported data URI (only {form} is read)", _FIX_DATA)
    data = _b64(payload, limits)
    if data is None:
        raise _fail(location, ref, "the data URI's payload is not valid base64", _FIX_DATA + f" ({form})")
    if isinstance(data, str):
        raise _fail(location, ref, f"the data URI's image is {data}", _FIX_BYTES)
    return _decode(data, location, ref, "the data URI's image", limits)


MAX_REDIRECTS = 5  # an image URL's redirects followed before it is refused
_NO_NETWORK = ("This machine may have no network access: download the image and give its local path in the "
               "data instead")


def _download(url: str, limits: ImageLimits) -> bytes | tuple[str, str]:
    """The body of `url`, or (why not, the fix). The whole download, connection included, gets
    `limits.url_timeout` seconds: it runs in a daemon thread that the caller stops waiting for at the
    deadline, and that itself stops at its next read or redirect after the deadline (each read waits at
    most `url_timeout`); at most MAX_REDIRECTS redirects are followed and `limits.max_bytes` + 1 bytes
    read."""
    import requests

    deadline = time.monotonic() + limits.url_timeout
    result: list = []

    def get(where: str):
        """The response at the end of `where`'s redirects (None past the deadline or MAX_REDIRECTS)."""
        for _ in range(MAX_REDIRECTS + 1):
            resp = requests.get(where, stream=True, timeout=limits.url_timeout, allow_redirects=False)
            if not resp.is_redirect:
                return resp
            resp.close()
            if time.monotonic() > deadline:
                return None
            where = urljoin(resp.url, resp.headers["location"])
        result.append((f"could not be downloaded: redirected more than {MAX_REDIRECTS} times",
                       "Fix the URL (give the image's final address)"))
        return None

    def fetch():
        try:
            resp = get(url)
            if resp is None:
                return
            with resp:
                if resp.status_code != 200:
                    result.append((f"could not be downloaded (HTTP {resp.status_code})",
                                   _NO_NETWORK + " (or fix the URL)"))
                    return
                data = bytearray()
                while chunk := resp.raw.read1(1 << 16, decode_content=True):
                    data += chunk
                    if len(data) > limits.max_bytes:
                        result.append((f"the download is {limits.over_bytes()}", _FIX_BYTES))
                        return
                    if time.monotonic() > deadline:
                        return
                result.append(bytes(data))
        except Exception as e:  # requests' RequestException, urllib3's errors while reading, ...
            result.append((f"could not be downloaded ({type(e).__name__}: {_clip(e, 100)})", _NO_NETWORK))

    worker = threading.Thread(target=fetch, name="posttrain-image-download", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if result:
        return result[0]
    return (f"not downloaded within --data.image_url_timeout {limits.url_timeout:g} s",
            "Raise --data.image_url_timeout for a slow server, or download the image and give its local path")


def _from_url(url: str, location: str, limits: ImageLimits) -> Image.Image:
    data = _download(url, limits)
    if isinstance(data, tuple):
        raise _fail(location, url, *data)
    return _decode(data, location, url, "the downloaded file", limits)


def _candidates(path: str, base_dir: str | None) -> list[str]:
    if os.path.isabs(path):
        return [path]
    tried = [os.path.abspath(path)]
    if base_dir is not None:
        other = os.path.abspath(os.path.join(base_dir, path))
        if other not in tried:
            tried.append(other)
    return tried


def _from_path(path: str, location: str, ref: Any, base_dir: str | None, allow_b64: bool,
               limits: ImageLimits) -> Image.Image:
    tried = _candidates(path, base_dir)
    for cand in tried:
        if os.path.exists(cand):
            return _from_file(cand, location, ref, limits)
    data = _b64(path, limits) if allow_b64 else None
    if isinstance(data, str) and len(path) >= _B64_MIN:
        raise _fail(location, ref, f"no such file, and as base64 it is {data}", _FIX_BYTES)
    if isinstance(data, bytes):
        img = _try_decode(data, limits)
        if not isinstance(img, str):
            return img
        if len(path) >= _B64_MIN:  # long base64 text: decoding it was the likely intent
            raise _fail(location, ref, f"no such file, and decoded as base64 ({len(data)} bytes) it is {img}",
                        _FIX_DATA)
    names = ", ".join(_short(t, 120) if len(t) > 120 else t for t in tried)
    where_hint = "relative paths are tried against the current folder" + (
        " and the data file's folder" if base_dir is not None else "")
    raise _fail(location, ref, f"file not found (tried: {names})",
                f"Fix the path in the data ({where_hint}), or give an absolute path")


def load_image(ref: Any, location: str, base_dir: str | None = None,
               limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> Image.Image:
    """The RGB image `ref` refers to (`to_rgb`), fully decoded (so a truncated file fails here, not later).

    `ref`: a PIL image; encoded image bytes; a Hugging Face Image-feature dict
    ``{"bytes": b | None, "path": p | None}`` (bytes win); or a string: a ``data:image/...;base64,`` URI,
    an http(s) URL, a ``file://`` URI, a path (absolute, or relative: the current folder first, then
    `base_dir`; a regular file), or, last, bare base64 of image bytes. Every read is bounded by `limits`
    (`ImageLimits`: bytes, pixels, a URL's total seconds). Any failure raises a one-line DataError starting
    with `location` and naming the shortened reference, the cause and the fix.
    """
    if isinstance(ref, Image.Image):
        return _from_pil(ref, location, limits)
    if isinstance(ref, (bytes, bytearray)):
        return _decode(bytes(ref), location, ref, "the byte string", limits)
    if isinstance(ref, dict) and ("bytes" in ref or "path" in ref):
        data, path = ref.get("bytes"), ref.get("path")
        if data is not None:
            if not isinstance(data, (bytes, bytearray)):
                raise _fail(location, ref, f"'bytes' must be bytes, got {type(data).__name__}", _FIX_DATA)
            return _decode(bytes(data), location, ref, "the 'bytes' of the image dict", limits)
        if isinstance(path, (str, os.PathLike)) and os.fspath(path):
            return _from_path(os.fspath(path), location, ref, base_dir, False, limits)
        raise _fail(location, ref, "the image dict has neither 'bytes' nor a 'path'", _FIX_DATA)
    if isinstance(ref, os.PathLike):
        return _from_path(os.fspath(ref), location, ref, base_dir, False, limits)
    if isinstance(ref, str):
        if not ref.strip():
            raise _fail(location, ref, "the reference is empty", _FIX_DATA + " (or remove the row)")
        low = ref[:8].lower()
        if low.startswith("data:"):
            return _from_data_uri(ref, location, limits)
        if low.startswith(("http://", "https://")):
            return _from_url(ref, location, limits)
        if low.startswith("file:"):
            parsed = urlparse(ref)
            if parsed.netloc not in ("", "localhost"):
                raise _fail(location, ref, f"file URI on another host ({parsed.netloc})",
                            "Use file:///absolute/path or a plain path")
            return _from_path(url2pathname(parsed.path), location, ref, base_dir, False, limits)
        return _from_path(ref, location, ref, base_dir, True, limits)
    raise _fail(location, ref, f"unsupported reference type {type(ref).__name__}",
                f"Fix the data: give {ACCEPTED}")


def _refs(value: Any) -> list:
    """The references of an image column's value: none (None), one, or a list/tuple without its None entries
    (the text-only rows of a mixed set, as OpenRLHF writes them)."""
    if value is None:
        return []
    return [ref for ref in value if ref is not None] if isinstance(value, (list, tuple)) else [value]


def _data_folder(row: dict) -> str | None:
    source = row.get("__source__")
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        return os.path.dirname(os.path.abspath(source))
    return None


def load_images(value: Any, location: str, base_dir: str | None = None,
                limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> list[Image.Image]:
    """The RGB images of an image column's value (one reference or a list, None entries skipped; see
    `load_image`, each read bounded by `limits`); a list's entries are located as ``location[i]``."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        return [load_image(value, location, base_dir, limits)]
    return [load_image(ref, f"{location}[{i}]", base_dir, limits) for i, ref in enumerate(_refs(value))]


def row_images(row: dict, image_key: str, max_images: int, base_dir: str | None = None,
               limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> list[Image.Image]:
    """The RGB images of `row[image_key]` (`load_images`, each read bounded by `limits`; key missing or None
    → []). More than `max_images` raises DataError before anything is loaded. `base_dir` defaults to the
    folder of ``row["__source__"]`` when that is an existing file."""
    value = row.get(image_key)
    key = f"{where(row)}, key '{image_key}'"
    if len(_refs(value)) > max_images:
        raise DataError(
            f"{key}: {len(_refs(value))} image(s), more than --data.max_images_per_prompt {max_images}. "
            "Raise --data.max_images_per_prompt, or drop images from the row."
        )
    return load_images(value, key, base_dir if base_dir is not None else _data_folder(row), limits)


def image_labels(row: dict, image_key: str) -> list[str]:
    """One label per image `row_images` returns, as its errors name them: the key (and list index) and the
    shortened reference, e.g. ``key 'images'[0]: image 'a.png'``."""
    value = row.get(image_key)
    if not isinstance(value, (list, tuple)):
        return [f"key '{image_key}': image {_short(ref)}" for ref in _refs(value)]
    return [f"key '{image_key}'[{i}]: image {_short(ref)}" for i, ref in enumerate(_refs(value))]


def row_image_refs(row: dict, image_key: str) -> Any:
    """`row[image_key]` as OpenRLHF hands it to an agent executor (one reference or a list, None entries
    kept), except that a relative file path that `row_images` found (current folder first, then the data
    file's folder) becomes that file's absolute path, so that the reference opens from any folder."""
    base_dir = _data_folder(row)

    def absolute(ref):
        if not isinstance(ref, str) or os.path.isabs(ref) or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", ref):
            return ref
        return next((cand for cand in _candidates(ref, base_dir) if os.path.isfile(cand)), ref)

    value = row.get(image_key)
    if isinstance(value, (list, tuple)):
        return type(value)(absolute(ref) for ref in value)
    return absolute(value)


def _parts_count(parts: list, where_: str) -> int:
    n = 0
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            n += 1
        elif kind not in TEXT_PART_TYPES:
            raise _bad_part(part, f"{where_}, part {j}")
    return n


def _bad_part(part: Any, where_: str) -> DataError:
    if isinstance(part, dict):
        why = f"unknown content part type {part.get('type')!r}"
    else:
        why = f"a content part must be a dict with a 'type', got {type(part).__name__} {_short(part, 60)}"
    return DataError(
        f"{where_}: {why}. Fix the data: parts are {{'type': 'text', 'text': ...}} or "
        f"{{'type': 'image'}} (OpenAI-style 'image_url' / 'input_image' parts also count as images)."
    )


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise DataError(f"the prompt must be text or a list of messages, got {type(value).__name__} "
                        f"{_short(value, 60)}. Fix the data.")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise DataError(f"message {i} must be a dict with 'role' and 'content', got {_short(msg, 60)}. "
                            "Fix the data.")
    return value


def count_image_parts(value: str | list[dict]) -> int:
    """The image placeholders of a prompt: ``<image>`` tags in a string; for a list of chat messages, the
    tags in string contents plus the image parts (type "image", "image_url" or "input_image") of list
    contents. Tags inside "text" parts are literal text and do not count. DataError on a malformed value."""
    if isinstance(value, str):
        return value.count(IMAGE_TAG)
    n = 0
    for i, msg in enumerate(_messages(value)):
        content = msg.get("content")
        if isinstance(content, str):
            n += content.count(IMAGE_TAG)
        elif isinstance(content, list):
            n += _parts_count(content, f"message {i}")
        elif content is not None:
            raise DataError(f"message {i}: content must be text or a list of parts, got "
                            f"{type(content).__name__} {_short(content, 60)}. Fix the data.")
    return n


def _text_to_parts(text: str) -> list[dict]:
    """Text with `<image>` tags as parts; each text piece is stripped and empty ones dropped (OpenRLHF's rule,
    so the same row gives the same tokens in both)."""
    parts: list[dict] = []
    for piece in re.split(f"({re.escape(IMAGE_TAG)})", text):
        if piece == IMAGE_TAG:
            parts.append({"type": "image"})
        elif piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


def to_vision_messages(messages: list[dict]) -> list[dict]:
    """Copies of `messages` whose contents are all lists of parts ``{"type": "text", "text": ...}`` /
    ``{"type": "image"}``: a string content is split at its ``<image>`` tags (text pieces stripped, empty ones
    dropped); in list contents, "image" / "image_url" / "input_image" parts become ``{"type": "image"}`` (an
    inline URL or payload is not kept: images come from the image column) and "text" / "input_text" parts
    ``{"type": "text", ...}``. A None content becomes []. Unknown part types raise DataError."""
    out = []
    for i, msg in enumerate(_messages(messages)):
        content = msg.get("content")
        if content is None:
            parts: list[dict] = []
        elif isinstance(content, str):
            parts = _text_to_parts(content)
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in IMAGE_PART_TYPES:
                    parts.append({"type": "image"})
                elif kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in TEXT_PART_TYPES:
                    raise DataError(f"message {i}, part {j}: a {kind!r} part needs a string 'text', got "
                                    f"{_short(part, 60)}. Fix the data.")
                else:
                    raise _bad_part(part, f"message {i}, part {j}")
        else:
            raise DataError(f"message {i}: content must be text or a list of parts, got "
                            f"{type(content).__name__} {_short(content, 60)}. Fix the data.")
        out.append({**msg, "content": parts})
    return out


def check_image_count(value: str | list[dict], images: list, location: str) -> None:
    """DataError unless the prompt `value` has exactly one image placeholder per image in `images`
    (no placeholders and no images is fine; images are never placed implicitly)."""
    try:
        n = count_image_parts(value)
    except DataError as e:
        raise DataError(f"{location}: {e}") from None
    if n != len(images):
        hint = (" Images inside message parts are not read: list them in the image column."
                if n > len(images) else "")
        raise DataError(
            f"{location}: the prompt has {n} image placeholder(s) but the row has {len(images)} image(s). "
            f"Put one {IMAGE_TAG} tag (text) or {{'type': 'image'}} part (messages) per image, in the "
            f"images' order, or fix the image column (--data.image_key).{hint}"
        )
