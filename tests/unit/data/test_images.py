"""posttrain.data.images: every accepted image reference loads to the same RGB pixels; every bad one
is a one-line DataError naming the location, the (shortened) reference and the fix; placeholder
counting and message normalisation for vision-language prompts."""

import base64
import io
import json
import os

import numpy as np
import pytest
import requests
from image_sources import FOREVER, declared_png, image_server, redirect, trickle
from PIL import Image

from posttrain.data.errors import DataError
from posttrain.data.images import (
    IMAGE_TAG,
    ImageLimits,
    check_image_count,
    count_image_parts,
    load_image,
    row_image_refs,
    row_images,
    to_vision_messages,
)

LOC = "d.jsonl, row 3, key 'images'"
W, H = 8, 6


def _pixels(x, y):
    return (x * 30, y * 40, (x + y) * 10)


def _image(mode="RGB"):
    img = Image.new("RGB", (W, H))
    for y in range(H):
        for x in range(W):
            img.putpixel((x, y), _pixels(x, y))
    if mode == "RGBA":
        img.putalpha(128)
    return img


def _png(img=None) -> bytes:
    buf = io.BytesIO()
    (img or _image()).save(buf, format="PNG")
    return buf.getvalue()


def _assert_pixels(img):
    assert img.mode == "RGB" and img.size == (W, H)
    assert [img.getpixel((x, y)) for y in range(H) for x in range(W)] == [
        _pixels(x, y) for y in range(H) for x in range(W)
    ]


def _error(ref, **kwargs) -> str:
    with pytest.raises(DataError) as err:
        load_image(ref, LOC, **kwargs)
    msg = str(err.value)
    assert msg.startswith(LOC + ": ") and "\n" not in msg
    return msg


@pytest.fixture
def png_file(tmp_path):
    path = tmp_path / "imgs" / "a.png"
    path.parent.mkdir()
    path.write_bytes(_png())
    return path


# --- every accepted form round-trips -------------------------------------------------------------


def test_absolute_path(png_file):
    _assert_pixels(load_image(str(png_file), LOC))


def test_pathlib_path(png_file):
    _assert_pixels(load_image(png_file, LOC))


def test_relative_to_base_dir(png_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "imgs")  # not found from the current folder as "imgs/a.png"
    _assert_pixels(load_image("imgs/a.png", LOC, base_dir=str(tmp_path)))


def test_image_refs_are_the_rows_value_with_found_relative_paths_absolute(png_file, tmp_path, monkeypatch):
    """What an agent executor gets (OpenRLHF passes the row's image column as is): one reference stays one,
    a list keeps its None entries and order; only a relative path found beside the data file becomes
    absolute."""
    monkeypatch.chdir(tmp_path / "imgs")
    source = tmp_path / "d.jsonl"
    source.write_text("{}\n")
    url, b64 = "https://example.com/x.png", base64.b64encode(_png()).decode()
    row = {"__source__": str(source), "images": ["imgs/a.png", None, url, b64, "missing.png"]}
    assert row_image_refs(row, "images") == [str(tmp_path / "imgs" / "a.png"), None, url, b64, "missing.png"]
    assert row_image_refs({**row, "images": "imgs/a.png"}, "images") == str(tmp_path / "imgs" / "a.png")
    assert row_image_refs({**row, "images": ("imgs/a.png",)}, "images") == (str(tmp_path / "imgs" / "a.png"),)
    assert row_image_refs({"images": "imgs/a.png"}, "images") == "imgs/a.png"  # no data file, not found here


def test_relative_to_cwd(png_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _assert_pixels(load_image("imgs/a.png", LOC))


def test_cwd_is_tried_before_base_dir(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    (tmp_path / "base").mkdir()
    (tmp_path / "cwd" / "x.png").write_bytes(_png())
    (tmp_path / "base" / "x.png").write_bytes(_png(Image.new("RGB", (W, H), (1, 2, 3))))
    monkeypatch.chdir(tmp_path / "cwd")
    _assert_pixels(load_image("x.png", LOC, base_dir=str(tmp_path / "base")))


def test_file_uri(png_file):
    _assert_pixels(load_image(png_file.as_uri(), LOC))
    _assert_pixels(load_image("file://localhost" + str(png_file), LOC))


def test_file_uri_with_escaped_characters(tmp_path):
    path = tmp_path / "my image.png"
    path.write_bytes(_png())
    assert "%20" in path.as_uri()
    _assert_pixels(load_image(path.as_uri(), LOC))
    escaped = tmp_path / "a%20b.png"  # unquoted once: a literal "%20" in a name survives
    escaped.write_bytes(_png())
    _assert_pixels(load_image(escaped.as_uri(), LOC))


def test_data_uri():
    b64 = base64.b64encode(_png()).decode()
    _assert_pixels(load_image(f"data:image/png;base64,{b64}", LOC))


def test_bare_base64():
    _assert_pixels(load_image(base64.b64encode(_png()).decode(), LOC))


def test_bare_base64_with_line_breaks():
    b64 = base64.encodebytes(_png()).decode()  # MIME style: a newline every 76 characters
    assert "\n" in b64.strip()
    _assert_pixels(load_image(b64, LOC))


def test_bytes_and_bytearray():
    _assert_pixels(load_image(_png(), LOC))
    _assert_pixels(load_image(bytearray(_png()), LOC))


def test_hf_dict_with_bytes_wins_over_path():
    _assert_pixels(load_image({"bytes": _png(), "path": "/nonexistent/elsewhere.png"}, LOC))


def test_hf_dict_with_path_only(png_file, tmp_path):
    _assert_pixels(load_image({"bytes": None, "path": str(png_file)}, LOC))
    _assert_pixels(load_image({"bytes": None, "path": "imgs/a.png"}, LOC, base_dir=str(tmp_path)))


def test_pil_images_are_converted_to_rgb():
    _assert_pixels(load_image(_image(), LOC))
    gray = load_image(Image.new("L", (W, H), 77), LOC)
    assert gray.mode == "RGB" and gray.getpixel((3, 2)) == (77, 77, 77)
    opaque = _image()
    opaque.putalpha(255)  # an alpha band that hides nothing changes nothing
    _assert_pixels(load_image(opaque, LOC))


def _transparent() -> Image.Image:
    """RGBA: a black opaque square, a half-transparent red patch, the rest fully transparent black (the stored
    colour of transparent pixels, which dropping the alpha band would show)."""
    img = Image.new("RGBA", (W, H), (0, 0, 0, 0))
    img.paste((0, 0, 0, 255), (1, 1, 4, 4))
    img.paste((200, 30, 40, 100), (5, 2, 8, 6))
    return img


def _palette_with_transparent_index() -> Image.Image:
    img = Image.new("P", (W, H), 0)
    img.putpalette([0, 0, 0, 10, 200, 30])
    img.paste(1, (2, 2, 5, 5))
    img.info["transparency"] = 0
    return img


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("make", [
    lambda: _transparent(),
    lambda: _transparent().convert("LA"),
    lambda: _palette_with_transparent_index(),
    lambda: _encoded(_transparent(), "PNG"),
    lambda: _encoded(_palette_with_transparent_index(), "PNG"),
    lambda: _encoded(_palette_with_transparent_index(), "GIF"),
    lambda: _encoded(Image.new("L", (W, H), 9), "PNG", transparency=9),
    lambda: _encoded(_image(), "PNG", transparency=_pixels(0, 0)),
    lambda: _transparent().quantize(4),  # a palette image without transparency: plain conversion
], ids=["RGBA", "LA", "P+transparency", "RGBA.png", "P.png", "P.gif", "L.png+tRNS", "RGB.png+tRNS", "P"])
def test_transparency_is_composited_over_white_as_the_processor_does(make):
    """Every kind of transparency gives the pixels of Hugging Face's `convert_to_rgb` (the processor's own
    rule, transparency over white), for a PIL image and for encoded bytes (then also once opened by PIL)."""
    from transformers.image_transforms import convert_to_rgb

    ref = make()
    img = Image.open(io.BytesIO(ref)) if isinstance(ref, bytes) else ref
    expected = convert_to_rgb(img, return_numpy=True)
    assert expected.shape == (H, W, 3)
    for given in (ref, img):
        ours = load_image(given, LOC)
        assert ours.mode == "RGB" and (np.asarray(ours) == expected).all()


def test_a_transparent_pixel_is_white_not_its_stored_colour():
    img = load_image(_encoded(_transparent(), "PNG"), LOC)
    assert img.getpixel((0, 0)) == (255, 255, 255)  # transparent black: white
    assert img.getpixel((2, 2)) == (0, 0, 0)  # opaque black stays black
    assert img.getpixel((6, 3)) == tuple(round((c * 100 + 255 * 155) / 255) for c in (200, 30, 40))


def test_other_formats_decode():
    buf = io.BytesIO()
    _image().save(buf, format="BMP")
    _assert_pixels(load_image(buf.getvalue(), LOC))
    gif = io.BytesIO()
    Image.new("P", (4, 4), 0).save(gif, format="GIF")
    assert load_image(gif.getvalue(), LOC).mode == "RGB"


def test_url_is_downloaded():
    with image_server({"/a.png": _png()}) as url:
        _assert_pixels(load_image(f"{url}/a.png", LOC))


# --- errors ----------------------------------------------------------------------------------------


def test_missing_file_names_the_paths_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = _error("nope/missing.png", base_dir=str(tmp_path / "data"))
    assert "file not found" in msg
    assert str(tmp_path / "nope" / "missing.png") in msg
    assert str(tmp_path / "data" / "nope" / "missing.png") in msg
    assert "'nope/missing.png'" in msg and "Fix the path" in msg


def test_missing_absolute_file(tmp_path):
    msg = _error(str(tmp_path / "gone.png"))
    assert f"file not found (tried: {tmp_path / 'gone.png'})" in msg


def test_missing_hf_path_and_file_uri(tmp_path):
    assert str(tmp_path / "gone.png") in _error({"bytes": None, "path": str(tmp_path / "gone.png")})
    assert str(tmp_path / "gone.png") in _error((tmp_path / "gone.png").as_uri())


def test_folder_is_not_an_image(tmp_path):
    assert "is a folder" in _error(str(tmp_path))


def test_corrupt_bytes():
    msg = _error(b"this is not an image at all")
    assert "the byte string is not an image (no format PIL can read)" in msg
    assert "or replace the image" in msg


def test_empty_bytes():
    assert "empty (0 bytes)" in _error(b"")


def _big_png() -> bytes:
    img = Image.frombytes("RGB", (64, 64), bytes((i * 7919) % 251 for i in range(64 * 64 * 3)))
    return _png(img)


def test_truncated_png_bytes_and_file(tmp_path):
    cut = _big_png()[:-400]
    msg = _error(cut)
    assert "a corrupt or truncated image (PIL OSError" in msg
    path = tmp_path / "cut.png"
    path.write_bytes(cut)
    msg = _error(str(path))
    assert f"file {path} is a corrupt or truncated image" in msg


def test_truncated_data_uri():
    b64 = base64.b64encode(_big_png()[:-400]).decode()
    msg = _error(f"data:image/png;base64,{b64}")
    assert "the data URI's image is a corrupt or truncated image" in msg and len(msg) < 300


def test_bad_data_uris():
    assert "unsupported data URI" in _error("data:text/plain;base64,aGVsbG8=")
    assert "unsupported data URI" in _error("data:image/png,rawdata")
    assert "not valid base64" in _error("data:image/png;base64,@@@@")


def test_unsupported_types_list_the_accepted_forms():
    msg = _error(42)
    assert "unsupported reference type int" in msg and "42" in msg
    assert "file path" in msg and "URL" in msg and "base64" in msg and "PIL image" in msg
    assert "unsupported reference type list" in _error([1, 2])
    assert "unsupported reference type dict" in _error({"url": "x.png"})


def test_bad_hf_dicts():
    assert "neither 'bytes' nor a 'path'" in _error({"bytes": None, "path": None})
    assert "'bytes' must be bytes, got str" in _error({"bytes": "abc", "path": None})


def test_empty_string():
    assert "empty" in _error("   ")


def test_url_connection_error_advises_a_local_path(monkeypatch):
    def fake_get(url, **kwargs):
        raise requests.ConnectionError("Failed to resolve 'example.invalid'")

    monkeypatch.setattr(requests, "get", fake_get)
    msg = _error("http://example.invalid/cat.png")
    assert "could not be downloaded" in msg and "ConnectionError" in msg
    assert "no network access" in msg and "local path" in msg
    assert "http://example.invalid/cat.png" in msg


def test_url_timeout_and_http_status(monkeypatch):
    with image_server({"/html": b"<html>not an image</html>"}) as url:
        msg = _error(f"{url}/missing.png")
        assert "HTTP 404" in msg and "local path" in msg
        assert "the downloaded file is not an image" in _error(f"{url}/html")

    def timeout_get(url, **kwargs):
        raise requests.Timeout("read timed out")

    monkeypatch.setattr(requests, "get", timeout_get)
    assert "Timeout" in _error("https://example.invalid/a.png")


# --- limits: every read is bounded ------------------------------------------------------------------


def test_an_endless_download_stops_at_the_byte_limit():
    with image_server({"/zeros.png": FOREVER}) as url:
        msg = _error(f"{url}/zeros.png", limits=ImageLimits(max_bytes=100_000))
    assert "the download is larger than --data.max_image_bytes 100,000" in msg and "zeros.png" in msg


def test_a_trickling_download_stops_at_the_total_deadline():
    """One byte every 0.2 s never trips a per-read timeout; the deadline is for the whole download."""
    with image_server({"/slow.png": trickle(0.2)}) as url:
        msg = _error(f"{url}/slow.png", limits=ImageLimits(url_timeout=1))
    assert "not downloaded within --data.image_url_timeout 1 s" in msg and "slow.png" in msg


def test_redirects_are_followed_up_to_five_then_refused():
    hits = {}
    routes = {"/loop": redirect("/loop"), "/moved.png": redirect("/a.png"), "/a.png": _png()}
    with image_server(routes, hits) as url:
        _assert_pixels(load_image(f"{url}/moved.png", LOC))
        msg = _error(f"{url}/loop")
    assert "could not be downloaded: redirected more than 5 times" in msg and "Fix the URL" in msg, msg
    assert hits["/loop"] == 6  # the first request and 5 redirects, not requests' 30


@pytest.mark.parametrize("kind", ["character device", "FIFO"])
def test_only_regular_files_are_read(tmp_path, kind, monkeypatch):
    """A device or FIFO is refused before it is opened (opening a tty could make it the controlling terminal,
    opening a device may act on it)."""
    path = "/dev/zero" if kind == "character device" else str(tmp_path / "f.png")
    if kind == "FIFO":
        os.mkfifo(path)  # nobody writes: opening it for reading would block
    opened, real_open = [], os.open

    def recording_open(file, *args, **kwargs):
        opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    msg = _error(path)
    assert f"{path} is a {kind}" in msg
    assert "regular files only" in msg
    assert path not in opened


def test_the_byte_limit_covers_files_bytes_and_data_uris(png_file):
    limits = ImageLimits(max_bytes=len(_png()) - 1)
    data_uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    for ref in (str(png_file), _png(), {"bytes": _png(), "path": None}, data_uri):
        msg = _error(ref, limits=limits)
        assert f"larger than --data.max_image_bytes {len(_png()) - 1:,} ({len(_png()):,} bytes)" in msg, msg
    _assert_pixels(load_image(str(png_file), LOC, limits=ImageLimits(max_bytes=len(_png()))))


def test_pils_bomb_check_stays_on_and_is_raised_only_for_a_higher_limit(monkeypatch):
    """Other threads open images while one is read: PIL's global limit is never switched off, and changed
    (raised to --data.max_image_pixels) only when that limit is above PIL's."""
    seen, real_open = [], Image.open

    def spy(*args, **kwargs):
        seen.append(Image.MAX_IMAGE_PIXELS)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", spy)
    _assert_pixels(load_image(_png(), LOC))
    high = ImageLimits(max_pixels=100_000_000)
    assert "too large: 400,000,000 pixels, more than" in _error(declared_png(20000, 20000), limits=high)
    assert "12000x10000 = 120,000,000 pixels" in _error(declared_png(12000, 10000), limits=ImageLimits())
    assert seen == [89_478_485, 100_000_000, 89_478_485] and Image.MAX_IMAGE_PIXELS == 89_478_485


def test_oversized_base64_is_refused_before_it_is_decoded(monkeypatch):
    """A data URI or bare base64 whose decoded size exceeds --data.max_image_bytes is refused from its length
    alone: decoding it would first hold the whole oversized payload in memory."""
    def no_decoding(*args, **kwargs):
        raise AssertionError("base64 decoded before the size check")

    monkeypatch.setattr(base64, "b64decode", no_decoding)
    limits = ImageLimits(max_bytes=1000)
    payload = "QUJD" * 334 + "QQ=="  # 1,002 + 1 bytes once decoded
    for ref in (f"data:image/png;base64,{payload}", payload, "\n".join([payload[:700], payload[700:]])):
        msg = _error(ref, limits=limits)
        assert ("larger than --data.max_image_bytes 1,000 (1,003 bytes)" in msg
                and "max_image_bytes" in msg), msg


def test_too_many_pixels_are_refused_from_the_header_as_too_large():
    msg = _error(declared_png(12000, 10000))  # within twice PIL's limit: read from the header
    assert "too large: 12000x10000 = 120,000,000 pixels, more than --data.max_image_pixels 89,478,485" in msg
    msg = _error(declared_png(20000, 20000))  # beyond it, PIL's own check refuses it first
    assert "too large: 400,000,000 pixels, more than --data.max_image_pixels 89,478,485" in msg
    assert "corrupt" not in msg
    small = ImageLimits(max_pixels=W * H - 1)
    assert f"more than --data.max_image_pixels {W * H - 1}" in _error(_png(), limits=small)
    assert "the PIL image is too large: 8x6 = 48 pixels" in _error(_image(), limits=small)
    _assert_pixels(load_image(_png(), LOC, limits=ImageLimits(max_pixels=W * H)))


def test_huge_base64_is_shortened():
    huge = base64.b64encode(bytes(range(256)) * 4000).decode()  # valid base64, not an image
    assert len(huge) > 1_000_000
    msg = _error(huge)
    assert len(msg) < 300, msg
    assert "no such file, and decoded as base64 (1024000 bytes) it is not an image" in msg
    assert f"({len(huge)} chars)" in msg
    assert huge[:200] not in msg


def test_huge_truncated_base64_image_is_shortened():
    huge = base64.b64encode(_big_png()[:-400]).decode()
    msg = _error(huge)
    assert "decoded as base64" in msg and "corrupt or truncated" in msg
    assert len(msg) < 300 and huge[:200] not in msg


def test_huge_bytes_are_shortened():
    msg = _error(b"\x00" * 1_000_000)
    assert "(1000000 bytes)" in msg and len(msg) < 300


# --- row_images ----------------------------------------------------------------------------------


def _row(**fields):
    return {"__source__": "d.jsonl", "__row__": 3, **fields}


def test_row_without_images():
    assert row_images(_row(), "images", 2) == []
    assert row_images(_row(images=None), "images", 2) == []
    assert row_images(_row(images=[]), "images", 0) == []


def test_row_with_one_or_several_images(png_file):
    [one] = row_images(_row(images=str(png_file)), "images", 1)
    _assert_pixels(one)
    several = row_images(_row(images=[str(png_file), _png(), {"bytes": _png(), "path": None}]), "images", 3)
    assert len(several) == 3
    for img in several:
        _assert_pixels(img)
    assert len(row_images(_row(pics=(_png(), _png())), "pics", 2)) == 2


def test_row_over_the_limit_is_refused_before_loading():
    with pytest.raises(DataError) as err:
        row_images(_row(images=["missing1.png", "missing2.png", "missing3.png"]), "images", 2)
    msg = str(err.value)
    assert msg.startswith("d.jsonl, row 3, key 'images': 3 image(s)")
    assert "--data.max_images_per_prompt 2" in msg and "not found" not in msg
    with pytest.raises(DataError, match="max_images_per_prompt 0"):
        row_images(_row(images="a.png"), "images", 0)


def test_row_error_location_names_key_and_index(tmp_path):
    with pytest.raises(DataError) as err:
        row_images(_row(images=[_png(), b"junk"]), "images", 4)
    assert str(err.value).startswith("d.jsonl, row 3, key 'images'[1]: image b'junk'")
    with pytest.raises(DataError) as err:
        row_images(_row(images=str(tmp_path / "x.png")), "images", 4)
    assert str(err.value).startswith(f"d.jsonl, row 3, key 'images': image '{tmp_path / 'x.png'}'")


def test_row_base_dir_defaults_to_the_data_files_folder(tmp_path, monkeypatch):
    data = tmp_path / "dataset"
    (data / "imgs").mkdir(parents=True)
    (data / "imgs" / "a.png").write_bytes(_png())
    source = data / "train.jsonl"
    source.write_text(json.dumps({"images": ["imgs/a.png"]}) + "\n")
    monkeypatch.chdir(tmp_path)  # "imgs/a.png" is not there
    row = {"images": ["imgs/a.png"], "__source__": str(source), "__row__": 1}
    [img] = row_images(row, "images", 1)
    _assert_pixels(img)
    with pytest.raises(DataError) as err:  # an explicit base_dir wins
        row_images(row, "images", 1, base_dir=str(tmp_path / "other"))
    assert str(tmp_path / "other" / "imgs" / "a.png") in str(err.value)
    with pytest.raises(DataError, match="file not found"):  # a source that is no file gives no base_dir
        row_images({**row, "__source__": "hub:some/dataset"}, "images", 1)


# --- placeholders ----------------------------------------------------------------------------------


def test_count_in_strings():
    assert IMAGE_TAG == "<image>"
    assert count_image_parts("no images") == 0
    assert count_image_parts("<image> what is this?") == 1
    assert count_image_parts("<image><image>compare\n<image>") == 3


def test_count_in_messages():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "<image> and"},
        {"role": "user", "content": [
            {"type": "image"},
            {"type": "text", "text": "then <image> in a text part is literal"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
            {"type": "input_image", "image_url": "https://example.invalid/b.png"},
            {"type": "input_text", "text": "hi"},
        ]},
        {"role": "assistant", "content": None},
    ]
    assert count_image_parts(messages) == 4
    assert count_image_parts([]) == 0


def test_count_rejects_unknown_parts_and_shapes():
    with pytest.raises(DataError, match="message 0, part 1: unknown content part type 'audio'"):
        count_image_parts([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "audio"}]}])
    with pytest.raises(DataError, match="got int"):
        count_image_parts(7)
    with pytest.raises(DataError, match="message 0: content must be text or a list of parts"):
        count_image_parts([{"role": "user", "content": 5}])


def test_to_vision_messages_splits_tags():
    messages = [
        {"role": "user", "content": "<image>What is in <image>?<image>", "name": "u1"},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": ""},
    ]
    original = json.loads(json.dumps(messages))
    assert to_vision_messages(messages) == [
        {"role": "user", "name": "u1", "content": [
            {"type": "image"},
            {"type": "text", "text": "What is in"},  # stripped, as OpenRLHF strips each piece
            {"type": "image"},
            {"type": "text", "text": "?"},
            {"type": "image"},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": []},
    ]
    assert messages == original  # inputs are not modified


def test_to_vision_messages_normalises_part_lists():
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "compare", "cache": True},
            {"type": "image", "image": "a.png"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            {"type": "input_text", "text": "please"},
        ]},
        {"role": "assistant", "content": None},
    ]
    out = to_vision_messages(messages)
    assert out == [
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image"},
            {"type": "image"},
            {"type": "image"},
            {"type": "text", "text": "please"},
        ]},
        {"role": "assistant", "content": []},
    ]
    assert count_image_parts(out) == count_image_parts(messages) == 3


def test_to_vision_messages_errors():
    with pytest.raises(DataError) as err:
        to_vision_messages([{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "x"}]}])
    assert "message 1, part 0: unknown content part type 'x'" in str(err.value)
    assert "{'type': 'image'}" in str(err.value)
    with pytest.raises(DataError, match="must be a dict with a 'type', got str"):
        to_vision_messages([{"role": "user", "content": ["plain string part"]}])
    with pytest.raises(DataError, match="'text' part needs a string 'text'"):
        to_vision_messages([{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(DataError, match="message 0 must be a dict"):
        to_vision_messages(["hello"])


def test_check_image_count_match():
    img = Image.new("RGB", (2, 2))
    check_image_count("no images", [], LOC)
    check_image_count("<image> what?", [img], LOC)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image_url"}]}]
    check_image_count(two, [img, img], LOC)


def test_check_image_count_mismatch():
    img = Image.new("RGB", (2, 2))
    with pytest.raises(DataError) as err:
        check_image_count("what is this?", [img], LOC)
    msg = str(err.value)
    assert msg.startswith(f"{LOC}: the prompt has 0 image placeholder(s) but the row has 1 image(s)")
    assert "<image> tag" in msg and "{'type': 'image'} part" in msg and "--data.image_key" in msg
    with pytest.raises(DataError) as err:
        check_image_count([{"role": "user", "content": "<image><image> diff?"}], [img], LOC)
    assert "has 2 image placeholder(s) but the row has 1 image(s)" in str(err.value)
    assert "not read" in str(err.value)
    with pytest.raises(DataError, match="has 1 image placeholder"):
        check_image_count("<image>", [], LOC)


def test_check_image_count_malformed_prompt_names_the_location():
    with pytest.raises(DataError) as err:
        check_image_count([{"role": "user", "content": [{"type": "audio"}]}], [], LOC)
    assert str(err.value).startswith(f"{LOC}: message 0, part 0: unknown content part type 'audio'")


def test_text_around_image_tags_is_stripped_as_openrlhf_does():
    assert to_vision_messages([{"role": "user", "content": "<image>\nFind x. "}])[0]["content"] == [
        {"type": "image"}, {"type": "text", "text": "Find x."}]


def test_none_entries_of_an_image_list_are_no_images(tmp_path):
    path = tmp_path / "a.png"
    Image.new("RGB", (8, 6), (10, 20, 30)).save(path)
    assert row_images({"images": [None]}, "images", 0) == []
    assert len(row_images({"images": [None, str(path)]}, "images", 1)) == 1
