"""multimodal/media.py: every source of a user image and every bad image of issue 29 item 4.

Images are made with PIL in the test (deterministic pixels); the conversion is compared with
transformers' own `convert_to_rgb` on the same decoded image (exact: both are Pillow's integer
operations). The http(s) cases run against a local server in a thread.
"""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from tidepool import envs
from tidepool.config import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, MediaConfig
from tidepool.engine.args import EngineArgs
from tidepool.multimodal.media import (
    ImageDecodeError,
    ImageTooLargeError,
    MediaError,
    MediaFetchError,
    MediaNotAllowedError,
    decode_image,
    image_from_url,
    load_image,
    to_rgb,
)

CONFIG = MediaConfig()


def _pixels(size: tuple[int, int] = (24, 16), channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)


def _encoded(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _reference(data: bytes) -> np.ndarray:
    """What transformers' image processors make of these bytes: Image.open, convert_to_rgb."""
    return convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)


def _rgba() -> Image.Image:
    pixels = _pixels(channels=4)
    pixels[..., 3] = np.linspace(0, 255, pixels.shape[1], dtype=np.uint8)  # every alpha level
    return Image.fromarray(pixels, "RGBA")


def _palette_with_transparency() -> Image.Image:
    image = Image.fromarray(_pixels(), "RGB").quantize(colors=16)
    image.info["transparency"] = 3  # palette entry 3 is transparent (a tRNS chunk)
    return image


def _sixteen_bit() -> Image.Image:
    values = (np.arange(24 * 16, dtype=np.uint16).reshape(16, 24) * 171).astype(np.uint16)
    return Image.fromarray(values)  # mode I;16, values up to 65,000


def _cmyk_jpeg() -> bytes:
    return _encoded(Image.fromarray(_pixels(channels=4), "CMYK"), "JPEG", quality=95)


def _animated_gif() -> bytes:
    frames = [Image.fromarray(_pixels(seed=s), "RGB").convert("P") for s in (1, 2, 3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buffer.getvalue()


CASES = {
    "rgb png": lambda: _encoded(Image.fromarray(_pixels(), "RGB")),
    "rgba png (alpha over white)": lambda: _encoded(_rgba()),
    "la png": lambda: _encoded(_rgba().convert("LA")),
    "grey png": lambda: _encoded(Image.fromarray(_pixels(channels=1)[..., 0], "L")),
    "palette png with transparency": lambda: _encoded(_palette_with_transparency()),
    "16-bit png": lambda: _encoded(_sixteen_bit()),
    "cmyk jpeg": _cmyk_jpeg,
    "animated gif": _animated_gif,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decoded_as_the_image_processor_converts(case: str) -> None:
    data = CASES[case]()
    expected = _reference(data)
    for source in (data, base64.b64encode(data).decode(), _data_url(data)):
        if isinstance(source, str) and not source.startswith("data:"):
            source = "data:;base64," + source  # plain base64 travels as a data: URL
        image = load_image(source, CONFIG)
        assert image.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(image), expected)


def test_the_conversions_are_the_ones_the_issue_names() -> None:
    """The reference itself is not trivial for these: alpha really goes over white, 16-bit
    values saturate, an animated image is its first frame."""
    rgba = _rgba()
    converted = np.asarray(load_image(_encoded(rgba), CONFIG)).astype(int)
    source = np.asarray(rgba).astype(int)
    alpha = source[..., 3:4] / 255
    np.testing.assert_allclose(converted, source[..., :3] * alpha + 255 * (1 - alpha), atol=1)
    sixteen = np.asarray(load_image(_encoded(_sixteen_bit()), CONFIG))
    assert sixteen.max() == 255 and (sixteen == 255).mean() > 0.9  # Pillow's convert saturates
    gif = _animated_gif()
    first = np.asarray(load_image(gif, CONFIG))
    frames = Image.open(io.BytesIO(gif))
    frames.seek(1)
    assert frames.n_frames == 3
    assert not np.array_equal(first, np.asarray(frames.convert("RGB")))


def test_a_pil_image_is_converted_and_rgb_kept() -> None:
    rgb = Image.fromarray(_pixels(), "RGB")
    assert load_image(rgb, CONFIG) is rgb
    rgba = _rgba()
    np.testing.assert_array_equal(np.asarray(to_rgb(rgba)), convert_to_rgb(rgba, return_numpy=True))


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, b"GIF89a" + b"\xff" * 10],
    ids=["empty", "text", "png signature only", "broken gif"],
)
def test_undecodable_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(ImageDecodeError, match="could not be decoded"):
        load_image(data, CONFIG)


def test_truncated_pixel_data_is_refused() -> None:
    data = _encoded(Image.fromarray(_pixels((64, 64)), "RGB"))
    with pytest.raises(ImageDecodeError, match="could not be decoded"):
        decode_image(data[: len(data) // 2], CONFIG)


def test_the_bytes_limit() -> None:
    assert DEFAULT_MAX_IMAGE_BYTES == 32 * 2**20  # a 100 MB file is over it
    assert CONFIG.max_image_bytes == DEFAULT_MAX_IMAGE_BYTES
    data = _encoded(Image.fromarray(_pixels((64, 64)), "RGB"))
    small = replace(CONFIG, max_image_bytes=len(data) - 1)
    for source in (data, _data_url(data)):
        with pytest.raises(ImageTooLargeError, match="--max-image-bytes"):
            load_image(source, small)
    load_image(data, replace(CONFIG, max_image_bytes=len(data)))  # at the limit: taken


def _png_header(width: int, height: int) -> bytes:
    """A PNG signature and IHDR chunk (valid CRC) claiming width x height RGB pixels, then one
    tiny IDAT: nothing of the claimed size exists."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00"))


def test_a_20000_by_20000_image_is_refused_from_its_header() -> None:
    assert DEFAULT_MAX_IMAGE_PIXELS == 89_478_485  # Pillow's MAX_IMAGE_PIXELS
    data = _png_header(20_000, 20_000)
    tracemalloc.start()
    try:
        with pytest.raises(ImageTooLargeError, match="too large|pixels"):
            load_image(data, CONFIG)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20  # a decoded 20k x 20k RGB image would be 1.2 GB
    # Our own limit, below Pillow's: the message names the size and the flag.
    with pytest.raises(ImageTooLargeError, match=r"300 x 200 = 60,000 pixels.*--max-image-pixels"):
        load_image(_png_header(300, 200), replace(CONFIG, max_image_pixels=59_999))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png,abc", "only base64"),
        ("data:image/png;base64", "needs a ','"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("ftp://host/x.png", "scheme 'ftp' is not supported"),
    ],
)
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        image_from_url(url, CONFIG)


def test_a_source_of_another_type_is_refused() -> None:
    with pytest.raises(ImageDecodeError, match="must be a PIL image, bytes"):
        load_image(12, CONFIG)


# ---------------------------------------------------------------------- local files


@pytest.fixture
def media_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "allowed"
    (folder / "sub").mkdir(parents=True)
    data = _encoded(Image.fromarray(_pixels(), "RGB"))
    (folder / "sub" / "a.png").write_bytes(data)
    (tmp_path / "secret.png").write_bytes(data)
    (folder / "escape.png").symlink_to(tmp_path / "secret.png")
    return folder


def test_local_files_need_the_flag(media_folder: Path) -> None:
    with pytest.raises(MediaNotAllowedError, match="--allowed-local-media-path"):
        load_image(str(media_folder / "sub" / "a.png"), CONFIG)


def test_local_files_inside_the_folder(media_folder: Path) -> None:
    config = EngineArgs(allowed_local_media_path=str(media_folder)).media_config()
    expected = np.asarray(Image.open(media_folder / "sub" / "a.png").convert("RGB"))
    for source in (
        str(media_folder / "sub" / "a.png"),
        (media_folder / "sub" / "a.png").as_uri(),
        "sub/a.png",  # relative: inside the folder
    ):
        np.testing.assert_array_equal(np.asarray(load_image(source, config)), expected)


@pytest.mark.parametrize(
    "name",
    ["../secret.png", "escape.png", "sub/../../secret.png"],
    ids=["dotdot", "symlink", "mixed"],
)
def test_paths_out_of_the_folder_are_refused(media_folder: Path, name: str) -> None:
    config = EngineArgs(allowed_local_media_path=str(media_folder)).media_config()
    for source in (name, str(media_folder / name)):
        with pytest.raises(MediaNotAllowedError, match="outside the allowed folder"):
            load_image(source, config)


def test_local_file_errors(media_folder: Path) -> None:
    config = EngineArgs(allowed_local_media_path=str(media_folder)).media_config()
    with pytest.raises(MediaFetchError, match="could not be read"):
        load_image("sub/missing.png", config)
    with pytest.raises(MediaNotAllowedError, match="names a host"):
        load_image("file://otherhost/x.png", config)
    size = (media_folder / "sub" / "a.png").stat().st_size
    with pytest.raises(ImageTooLargeError):
        load_image("sub/a.png", replace(config, max_image_bytes=size - 1))
    with pytest.raises(ValueError, match="is not a folder"):
        EngineArgs(allowed_local_media_path=str(media_folder / "sub" / "a.png")).media_config()


# ---------------------------------------------------------------------- http(s)


PNG = _encoded(Image.fromarray(_pixels(), "RGB"))


class _Handler(BaseHTTPRequestHandler):
    hits: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        _Handler.hits.append(self.path)
        port = self.server.server_address[1]
        if self.path == "/slow":
            time.sleep(2.0)
        if self.path.startswith("/redirect-to/"):
            self.send_response(302)
            host = self.path.removeprefix("/redirect-to/")
            self.send_header("Location", f"http://{host}:{port}/img.png")
            self.end_headers()
            return
        if self.path == "/missing":
            self.send_error(404)
            return
        body = PNG * 40 if self.path == "/big" else PNG
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/chunked-big":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(PNG * 40 if self.path == "/chunked-big" else body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading at its bytes limit


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


LISTED = replace(CONFIG, allowed_media_domains=("127.0.0.1",), fetch_timeout_s=0.5)


def test_an_allowed_host(server: str) -> None:
    expected = np.asarray(Image.open(io.BytesIO(PNG)).convert("RGB"))
    np.testing.assert_array_equal(np.asarray(load_image(f"{server}/img.png", LISTED)), expected)


def test_http_needs_a_flag(server: str) -> None:
    _Handler.hits.clear()
    with pytest.raises(MediaNotAllowedError, match="--allowed-media-domains HOST... or --allow-"):
        load_image(f"{server}/img.png", CONFIG)
    with pytest.raises(MediaNotAllowedError, match="not one of --allowed-media-domains"):
        load_image(f"{server}/img.png", replace(CONFIG, allowed_media_domains=("example.com",)))
    assert _Handler.hits == []  # refused before any request


def test_remote_media_is_public_hosts_only(server: str) -> None:
    with pytest.raises(MediaNotAllowedError, match="private, loopback or link-local"):
        load_image(f"{server}/img.png", replace(CONFIG, allow_remote_media=True))


def test_a_url_that_times_out(server: str) -> None:
    start = time.monotonic()
    with pytest.raises(MediaFetchError, match=r"within 0.5 s \(VLLM_IMAGE_FETCH_TIMEOUT\)"):
        load_image(f"{server}/slow", LISTED)
    assert time.monotonic() - start < 1.5


def test_redirects_are_checked_hop_by_hop(server: str) -> None:
    expected = np.asarray(Image.open(io.BytesIO(PNG)).convert("RGB"))
    followed = load_image(f"{server}/redirect-to/127.0.0.1", LISTED)
    np.testing.assert_array_equal(np.asarray(followed), expected)
    _Handler.hits.clear()
    with pytest.raises(MediaNotAllowedError, match="'localhost' is not one of"):
        load_image(f"{server}/redirect-to/localhost", LISTED)
    assert _Handler.hits == ["/redirect-to/localhost"]  # the disallowed hop was never fetched


def test_redirects_off(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    with pytest.raises(MediaFetchError, match="redirects are off"):
        load_image(f"{server}/redirect-to/127.0.0.1", LISTED)


@pytest.mark.parametrize("path", ["/big", "/chunked-big"])
def test_a_download_over_the_bytes_limit(server: str, path: str) -> None:
    with pytest.raises(ImageTooLargeError, match="--max-image-bytes"):
        load_image(server + path, replace(LISTED, max_image_bytes=len(PNG) * 2))


def test_an_http_error_status(server: str) -> None:
    with pytest.raises(MediaFetchError, match="HTTP 404"):
        load_image(f"{server}/missing", LISTED)


def test_the_fetch_timeout_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    assert EngineArgs().media_config().fetch_timeout_s == 2.5
    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT")
    assert envs.image_fetch_timeout_s() == 5.0  # vLLM's default
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT"):
        EngineArgs().media_config()
