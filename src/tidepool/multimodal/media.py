"""User images → RGB PIL images, the `multi_modal_data` vLLM's offline API takes.

    PIL image ─────────────────────────────────────────────────────┐
    bytes ──────────────────────────────────────── decode_image ───┤
    "data:image/png;base64,..."  (base64 only) ──── decode_image ───┤── to_rgb ──▶ RGB image
    "https://..."  (allow_remote_media / allowed_media_domains) ───┤
    "/path", "file:///path"  (inside allowed_local_media_path) ────┘

Every refusal is a `MediaError` (a ValueError) whose message names the image and the limit or
flag involved; the server answers it with a 400 in the route's shape, and nothing else of the
request runs. The limits (tidepool.config.MediaConfig): the encoded bytes (max_image_bytes,
checked before reading past it: a Content-Length, a file's size, a data: URL's length), the
pixels (max_image_pixels, read from the header before any pixel is decoded: a decompression bomb
costs nothing), the download's time (fetch_timeout_s, the whole download), and where an image may
come from: http(s) only with allow_remote_media (not to private, loopback or link-local
addresses) or from allowed_media_domains (each redirect hop checked too), local files only inside
allowed_local_media_path (resolved first, so a symlink or `..` out of it is outside).

Conversion is transformers' `convert_to_rgb` (what the image processors do with
do_convert_rgb): an image with alpha (RGBA, LA, a palette or grey image with a transparent
colour) is composited over white, anything else (CMYK, 16-bit grey, palette) goes through
Pillow's convert("RGB") (which saturates 16-bit values above 255, as the processor does). An
animated image is its first frame. EXIF orientation is not applied (neither the processors nor
vLLM apply it to an image they are given).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import re
import socket
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import url2pathname

from tidepool import envs
from tidepool.config import MediaConfig

_MAX_REDIRECTS = 5
_CHUNK = 1 << 16
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


class MediaError(ValueError):
    """An image that cannot be used: the message says which and why."""


class ImageDecodeError(MediaError):
    """The bytes are not an image Pillow can decode (or the source is not an image at all)."""


class ImageTooLargeError(MediaError):
    """Over max_image_bytes or max_image_pixels."""


class MediaNotAllowedError(MediaError):
    """A source the configuration does not allow: a host, a scheme, a path outside the folder."""


class MediaFetchError(MediaError):
    """The download failed: a timeout, an HTTP error status, a connection error, no such file."""


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow comes with the images extra
        raise MediaError("image inputs need Pillow: pip install 'tidepool[images]'") from e
    return Image


def is_pil_image(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, Image.Image)


# ---------------------------------------------------------------------- decoding


def to_rgb(image: Any) -> Any:
    """transformers' convert_to_rgb: alpha (or a transparent colour) composited over white,
    else Pillow's convert("RGB"); an RGB image is returned as it is."""
    image_module = _pil()
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = image_module.new("RGBA", rgba.size, (255, 255, 255, 255))
        return image_module.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, config: MediaConfig, what: str = "the image") -> Any:
    """Encoded bytes → an RGB image: the bytes limit, the pixel limit from the header, then
    the first frame decoded and converted (MediaError for each refusal)."""
    image_module = _pil()
    check_bytes(len(data), config, what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", image_module.DecompressionBombWarning)
            image = image_module.open(io.BytesIO(data))
    except image_module.DecompressionBombError as e:
        raise ImageTooLargeError(f"{what} is too large: {e}") from e
    except Exception as e:  # UnidentifiedImageError, and a header a decoder cannot parse
        raise ImageDecodeError(
            f"{what} could not be decoded as an image ({len(data)} bytes, starting "
            f"{bytes(data[:8])!r}): {e}"
        ) from e
    width, height = image.size
    if width * height > config.max_image_pixels:
        raise ImageTooLargeError(
            f"{what} is {width} x {height} = {width * height:,} pixels, more than the limit of "
            f"{config.max_image_pixels:,} (--max-image-pixels)"
        )
    try:
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)  # an animated image: its first frame
        image.load()
        rgb = to_rgb(image)
    except Exception as e:  # truncated or corrupt pixel data
        raise ImageDecodeError(f"{what} could not be decoded ({image.format} image): {e}") from e
    rgb.info[SOURCE_INFO] = (image.format, image.mode)
    return rgb


SOURCE_INFO = "tidepool.source"
"""The `info` key of a decoded image: (format, mode) of the encoded image it came from ("PNG",
"I;16"), as Cohere's response reports them."""
_BITS = {"1": 1, "I": 32, "F": 32, "I;16": 16, "I;16B": 16, "I;16L": 16, "I;16N": 16}


def source_description(image: Any) -> dict[str, Any]:
    """Width, height, format and bits per channel of a decoded image's source (Cohere's
    `images` items); an image given as a PIL image describes itself."""
    fmt, mode = image.info.get(SOURCE_INFO, (image.format, image.mode))
    width, height = image.size
    return {
        "width": width,
        "height": height,
        "format": (fmt or "unknown").lower(),
        "bit_depth": _BITS.get(mode, 8),
    }


def check_bytes(num_bytes: int, config: MediaConfig, what: str) -> None:
    if num_bytes > config.max_image_bytes:
        raise ImageTooLargeError(
            f"{what} has {num_bytes:,} bytes or more, more than the limit of "
            f"{config.max_image_bytes:,} (--max-image-bytes)"
        )


def decode_base64(text: str, config: MediaConfig, what: str = "the image") -> bytes:
    """Base64 (standard alphabet, padding, no line breaks) → bytes, refused before decoding when
    the result would exceed max_image_bytes."""
    check_bytes(len(text) // 4 * 3, config, what)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageDecodeError(f"{what} is not valid base64: {e}") from e


# ---------------------------------------------------------------------- sources


def load_image(source: Any, config: MediaConfig, what: str = "the image") -> Any:
    """A PIL image, encoded bytes or a URL / path string → an RGB PIL image (MediaError)."""
    if is_pil_image(source):
        if getattr(source, "n_frames", 1) > 1:
            source.seek(0)
        return to_rgb(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), config, what)
    if isinstance(source, str):
        return image_from_url(source, config, what)
    raise ImageDecodeError(
        f"{what} must be a PIL image, bytes, or a data:, http(s):, file: URL or path string, "
        f"got {type(source).__name__}"
    )


def image_from_url(url: str, config: MediaConfig, what: str = "the image") -> Any:
    """A data: URL, an http(s) URL, a file: URL or a local path → an RGB image."""
    scheme_match = _SCHEME.match(url)
    scheme = scheme_match.group(1).lower() if scheme_match else None
    if scheme == "data":
        return decode_image(data_url_bytes(url, config, what), config, what)
    if scheme in ("http", "https"):
        return decode_image(fetch_bytes(url, config, what), config, what)
    if scheme == "file":
        return decode_image(read_local(file_url_path(url, what), config, what), config, what)
    if scheme is not None:
        raise MediaNotAllowedError(
            f"{what}: the URL scheme {scheme!r} is not supported; give a data: URL (base64), "
            "an http(s) URL or a local file"
        )
    return decode_image(read_local(url, config, what), config, what)


def data_url_bytes(url: str, config: MediaConfig, what: str = "the image") -> bytes:
    """RFC 2397's data:[<mediatype>][;param]*;base64,<data> → the bytes (base64 only, as vLLM)."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageDecodeError(f"{what}: a data: URL needs a ',' before its data ({url[:40]!r})")
    params = header.split(";")
    if params[-1].strip().lower() != "base64":
        raise ImageDecodeError(
            f"{what}: only base64 data: URLs are supported (data:image/png;base64,...), got "
            f"{url[:40]!r}"
        )
    media_type = params[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise ImageDecodeError(f"{what}: a data: URL of type {media_type!r} is not an image")
    return decode_base64(payload, config, what)


# ---------------------------------------------------------------------- local files


def file_url_path(url: str, what: str = "the image") -> str:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaNotAllowedError(
            f"{what}: a file: URL names a host ({parts.netloc!r}); only local files are read"
        )
    return url2pathname(unquote(parts.path))


def read_local(path_text: str, config: MediaConfig, what: str = "the image") -> bytes:
    """A local file's bytes, only inside allowed_local_media_path (a relative path is taken
    inside it); the path is resolved first (symlinks, `..`), then checked."""
    root = config.allowed_local_media_path
    if root is None:
        raise MediaNotAllowedError(
            f"{what}: local files are not allowed; start with --allowed-local-media-path "
            "(LLM(allowed_local_media_path=...)) to read images from a folder, or send the image "
            "as a data: URL"
        )
    path = Path(path_text)
    resolved = (path if path.is_absolute() else root / path).resolve()
    if root not in resolved.parents:
        raise MediaNotAllowedError(
            f"{what}: the file {path_text!r} is outside the allowed folder "
            f"(--allowed-local-media-path {root})"
        )
    try:
        size = resolved.stat().st_size
        check_bytes(size, config, what)
        with resolved.open("rb") as f:
            data = f.read(config.max_image_bytes + 1)
    except OSError as e:
        raise MediaFetchError(f"{what}: the file {path_text!r} could not be read: {e}") from e
    check_bytes(len(data), config, what)
    return data


# ---------------------------------------------------------------------- http(s)


def check_remote_url(url: str, config: MediaConfig, what: str = "the image") -> None:
    """One hop of a download: http(s), a host the configuration allows (MediaNotAllowedError)."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaNotAllowedError(f"{what}: {url[:60]!r} is not an http(s) URL")
    host = (parts.hostname or "").lower()
    if not host:
        raise MediaNotAllowedError(f"{what}: the URL {url[:60]!r} has no host")
    domains = config.allowed_media_domains
    if domains is not None:
        if host not in {d.lower() for d in domains}:
            raise MediaNotAllowedError(
                f"{what}: the host {host!r} is not one of --allowed-media-domains "
                f"({', '.join(domains)})"
            )
        return  # a listed host is trusted as listed, private or not
    if not config.allow_remote_media:
        raise MediaNotAllowedError(
            f"{what}: http(s) images are not allowed on this server; start it with "
            "--allowed-media-domains HOST... or --allow-remote-media, or send the image as a "
            "data: URL"
        )
    _check_public_host(host, parts.port, what)


def _check_public_host(host: str, port: int | None, what: str) -> None:
    """--allow-remote-media fetches from public addresses only (no SSRF into the network)."""
    try:
        infos = socket.getaddrinfo(host, port or 443, type=socket.SOCK_STREAM)
    except OSError as e:
        raise MediaFetchError(f"{what}: the host {host!r} could not be resolved: {e}") from e
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        mapped = getattr(address, "ipv4_mapped", None)
        address = mapped or address
        if not address.is_global or address.is_multicast:
            raise MediaNotAllowedError(
                f"{what}: the host {host!r} resolves to {address}, a private, loopback or "
                "link-local address; --allow-remote-media fetches from public hosts only (list "
                "the host in --allowed-media-domains to allow it)"
            )


def fetch_bytes(url: str, config: MediaConfig, what: str = "the image") -> bytes:
    """GET an http(s) image within fetch_timeout_s and max_image_bytes; each redirect hop is
    checked like the first URL (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0: none followed)."""
    deadline = time.monotonic() + config.fetch_timeout_s
    allow_redirects = envs.media_url_allow_redirects()
    for _ in range(_MAX_REDIRECTS + 1):
        check_remote_url(url, config, what)
        try:
            status, location, data = _get(url, config, deadline, what)
        except TimeoutError as e:
            raise MediaFetchError(
                f"{what}: {url[:80]!r} did not arrive within {config.fetch_timeout_s:g} s "
                "(VLLM_IMAGE_FETCH_TIMEOUT)"
            ) from e
        except (OSError, http.client.HTTPException) as e:
            raise MediaFetchError(f"{what}: {url[:80]!r} could not be fetched: {e}") from e
        if location is None:
            return data
        if not allow_redirects:
            raise MediaFetchError(
                f"{what}: {url[:80]!r} redirects (HTTP {status}) and redirects are off "
                "(VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)"
            )
        url = urljoin(url, location)
    raise MediaFetchError(f"{what}: more than {_MAX_REDIRECTS} redirects")


def _get(
    url: str, config: MediaConfig, deadline: float, what: str
) -> tuple[int, str | None, bytes]:
    """(status, redirect location or None, body) of one GET; the body is read in chunks, each
    read given only the time left (TimeoutError past the deadline)."""
    parts = urlsplit(url)
    kind = (
        http.client.HTTPSConnection
        if parts.scheme.lower() == "https"
        else http.client.HTTPConnection
    )
    conn = kind(parts.hostname or "", parts.port, timeout=_time_left(deadline))
    try:
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        conn.request("GET", target, headers={"User-Agent": "tidepool", "Accept": "image/*"})
        response = conn.getresponse()
        if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
            return response.status, response.getheader("Location"), b""
        if not 200 <= response.status < 300:
            raise MediaFetchError(f"{what}: {url[:80]!r} answered HTTP {response.status}")
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit():
            check_bytes(int(length), config, what)
        chunks: list[bytes] = []
        size = 0
        while True:
            if conn.sock is not None:
                conn.sock.settimeout(_time_left(deadline))
            chunk = response.read(_CHUNK)
            if not chunk:
                return response.status, None, b"".join(chunks)
            size += len(chunk)
            check_bytes(size, config, what)
            chunks.append(chunk)
    finally:
        conn.close()


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the fetch timeout ran out")
    return left
