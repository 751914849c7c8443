"""`serve`'s `/v1/images/edits` with a `mask` (and `strength`): the first image is the init image,
the mask is read by its gray levels (white: repaint) or, when it has transparency, by OpenAI's rule
(transparent: repaint); the image equals `edit --init-image --mask` with the same seed, bit for bit.
One server (tiny, fp32), through the official openai client."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.test_serve import KEY, Server, auth, client, png, start

pytestmark = pytest.mark.slow  # a server of its own, an inpaint shape compiled, and one CLI run (~60 s)
SIDE = 64  # the least side of an uploaded image


def encoded(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def init_image() -> Image.Image:
    y, x = np.mgrid[0:SIDE, 0:SIDE]
    return Image.fromarray(np.stack([x * 4, y * 4, np.full_like(x, 80)], -1).astype(np.uint8))


def gray_mask() -> Image.Image:
    pixels = np.zeros((SIDE, SIDE), np.uint8)
    pixels[16:44, 8:40] = 255
    return Image.fromarray(pixels, "L")


def alpha_mask() -> Image.Image:
    """OpenAI's form of gray_mask: opaque (kept) everywhere but a transparent hole (repainted)."""
    rgba = np.zeros((SIDE, SIDE, 4), np.uint8)
    rgba[..., :3] = 200  # colour under the alpha is ignored
    rgba[..., 3] = 255 - np.asarray(gray_mask())
    return Image.fromarray(rgba, "RGBA")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start(tmp_path_factory.mktemp("serve-inpaint"), env={"FLUX2KLEIN_API_KEY": KEY})
    yield running
    running.stop()


EXTRA = {"seed": 3, "steps": 2, "strength": 0.7}


def edit(server: Server, mask: Image.Image | None, **extra: object) -> np.ndarray:
    kwargs = {} if mask is None else {"mask": ("mask.png", encoded(mask), "image/png")}
    result = client(server).images.edit(image=("init.png", encoded(init_image()), "image/png"), prompt="a red ball",
                                        extra_body={**EXTRA, **extra}, **kwargs)
    return np.asarray(png(result.data[0].b64_json).convert("RGB"))


def test_a_masked_edit_equals_the_cli_and_reads_both_mask_conventions(server: Server, tmp_path: Path) -> None:
    gray = edit(server, gray_mask())
    assert gray.shape == (SIDE, SIDE, 3)
    np.testing.assert_array_equal(edit(server, alpha_mask()), gray)
    img2img = edit(server, None)  # strength alone: image-to-image from the first image
    assert not np.array_equal(img2img, gray)
    init_image().save(tmp_path / "init.png")
    gray_mask().save(tmp_path / "mask.png")
    environ = {**os.environ, "FLUX2KLEIN_CACHE": str(server.log.parent / "cache"), "FLUX2KLEIN_XLA_CACHE": "off"}
    cli = subprocess.run([sys.executable, "-m", "flux2klein_cli", "edit", "a red ball", "--model", "tiny", "--dtype",
                          "fp32", "--max-sequence-length", "32", "--steps", "2", "--seed", "3", "--strength", "0.7",
                          "--init-image", str(tmp_path / "init.png"), "--mask", str(tmp_path / "mask.png"), "-o",
                          str(tmp_path / "cli.png")], env=environ, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "cli.png").convert("RGB")), gray)
    cropped = edit(server, gray_mask(), padding_mask_crop=4)
    keep = np.asarray(gray_mask()) == 0
    np.testing.assert_array_equal(cropped[keep], np.asarray(init_image())[keep])


@pytest.mark.parametrize(("files", "data", "param", "words"), [
    ({"mask": ("m.png", encoded(gray_mask().resize((SIDE + 16, SIDE))), "image/png")}, {}, "mask",
     "is 80x64 but the init image (image) is 64x64"),
    ({"mask": ("m.png", encoded(Image.new("RGB", (SIDE, SIDE), (255, 0, 0))), "image/png")}, {}, "mask",
     "not grayscale"),
    ({"mask": ("m.png", encoded(gray_mask()), "image/png"), "mask[]": ("n.png", encoded(gray_mask()), "image/png")},
     {}, "mask", "give one"),
    ({}, {"strength": "1.5"}, "strength", "(0, 1]"),
    ({}, {"padding_mask_crop": "4"}, "padding_mask_crop", "needs a mask"),
    ({"mask": ("m.png", encoded(gray_mask()), "image/png")}, {"size": "32x32"}, "size", "set by the init image"),
])
def test_bad_masked_edits_are_400_naming_the_field(server: Server, files: dict, data: dict, param: str,
                                                   words: str) -> None:
    upload = {"image": ("init.png", encoded(init_image()), "image/png"), **files}
    response = httpx.post(server.url + "/v1/images/edits", data={"prompt": "x", **data}, files=upload,
                          headers=auth(), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_raises_on_a_bad_mask(server: Server) -> None:
    with pytest.raises(openai.BadRequestError):
        client(server).images.edit(image=("init.png", encoded(init_image()), "image/png"), prompt="x",
                                   mask=("m.png", encoded(Image.new("L", (SIDE + 16, SIDE))), "image/png"))
