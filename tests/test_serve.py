"""`flux2klein serve` as a real process on 127.0.0.1: the official openai client, bounded load,
bad requests of each kind, the API key, 429 and the SIGTERM drain.

Every server here binds 127.0.0.1 on a free port; every request goes to it alone, with timeouts.
The servers share the session's executable store (tests/conftest.py), so the second one loads
what the first compiled: `tiny` at 32x32, batches of 1 and 2 (--max-batch 2).
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# httpx and openai come with the [serve] and [dev] extras: tests/conftest.py collects this file only then.
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.fixtures.images import assert_same_seed_image

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

KEY = "serve-test-key-0123456789"
START_TIMEOUT = 300.0  # the first server compiles its warm shapes (two batch sizes) on a shared CPU
BASE_FLAGS = ["--model", "tiny", "--dtype", "fp32", "--max-batch", "2", "--max-sequence-length", "32",
              "--warm", "32x32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def start(tmp: Path, *flags: str, env: dict[str, str] | None = None, ready: bool = True) -> Server:
    port = free_port()
    log = tmp / f"serve-{port}.log"
    environ = {**os.environ, "FLUX2KLEIN_CACHE": str(tmp / "cache"), "FLUX2KLEIN_XLA_CACHE": "off", **(env or {})}
    if "FLUX2KLEIN_API_KEY" not in (env or {}):
        environ.pop("FLUX2KLEIN_API_KEY", None)
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "flux2klein_cli", "serve", *BASE_FLAGS, "--host",
                                    "127.0.0.1", "--port", str(port), *flags], stdout=out, stderr=out, env=environ)
    server = Server(process, port, log)
    if ready:
        wait_ready(server)
    return server


def wait_ready(server: Server, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"serve exited {server.process.returncode}: {server.stderr()}")
        try:
            if httpx.get(server.url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.stop()
    raise AssertionError(f"serve not ready in {timeout} s: {server.stderr()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start(tmp_path_factory.mktemp("serve"), "--queue", "16", "--max-body-mb", "1",
                    env={"FLUX2KLEIN_API_KEY": KEY})
    yield running
    running.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def png(data: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


def reference_png(side: int = 64) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 40, 30)).save(out, format="PNG")
    return out.getvalue()


def post(server: Server, body: object, **kw: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/images/generations", json=body, headers=auth(), timeout=120, **kw)


# ----------------------------------------------------------------------------- the openai client


def test_openai_client_generates(server: Server) -> None:
    result = client(server).images.generate(model="tiny", prompt="a red fox in snow", size="32x32", n=2,
                                            response_format="b64_json", extra_body={"seed": 3})
    assert result.created > 0 and len(result.data) == 2
    images = [png(item.b64_json) for item in result.data]
    assert all(image.size == (32, 32) and image.mode == "RGB" for image in images)
    assert images[0].tobytes() != images[1].tobytes()  # seeds 3 and 4
    again = client(server).images.generate(prompt="a red fox in snow", size="32x32", extra_body={"seed": 3})
    assert_same_seed_image(np.asarray(png(again.data[0].b64_json)), np.asarray(images[0]))  # the same seed


@pytest.mark.slow
def test_openai_client_edits(server: Server, tmp_path: Path) -> None:
    path = tmp_path / "ref.png"
    path.write_bytes(reference_png())
    with path.open("rb") as image:
        result = client(server).images.edit(model="tiny", image=image, prompt="make it blue", size="32x32",
                                            response_format="b64_json", extra_body={"seed": 1})
    assert len(result.data) == 1 and png(result.data[0].b64_json).size == (32, 32)
    with path.open("rb") as a, path.open("rb") as b:  # image[]: two references
        two = client(server).images.edit(image=[a, b], prompt="both", size="32x32")
    assert png(two.data[0].b64_json).size == (32, 32)


# ----------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "a fox", "size": "33x32"}, "size", "16"),
    ({"prompt": "a fox", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a fox", "steps": 0}, "steps", "at least"),
    ({"prompt": "a fox", "n": 0}, "n", "at least"),
    ({"prompt": "a fox", "n": 100000}, "n", "at most"),
    ({"prompt": "x" * (64 * 1024 + 1)}, "prompt", "bytes"),
    ({"prompt": "a fox", "response_format": "url"}, "response_format", "b64_json"),
    ({"prompt": "a fox", "model": "dall-e-3"}, "model", "tiny"),
    ({"prompt": "a fox", "colour": "red"}, "colour", "not a field"),
    ({"size": "32x32"}, "prompt", "missing"),
    ({"prompt": "a fox", "n": "two"}, "n", "integer"),
])
def test_bad_fields_are_400_naming_the_field(server: Server, body: dict, param: str, words: str) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]


def test_the_openai_client_raises_on_a_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).images.generate(prompt="a fox", size="32x32", response_format="url")
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]


def test_oversized_bodies_are_413(server: Server) -> None:
    response = httpx.post(server.url + "/v1/images/generations", content=b"{" + b" " * (2 * 1024 * 1024) + b"}",
                          headers={**auth(), "content-type": "application/json"}, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_uploads_that_are_not_images_are_400(server: Server) -> None:
    files = {"image": ("notes.png", b"not a png at all", "image/png")}
    response = httpx.post(server.url + "/v1/images/edits", data={"prompt": "x"}, files=files, headers=auth(),
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "image"
    assert "not an image" in response.json()["error"]["message"]
    mask = {"image": ("a.png", reference_png(), "image/png"), "mask": ("m.png", reference_png(), "image/png")}
    response = httpx.post(server.url + "/v1/images/edits", data={"prompt": "x"}, files=mask, headers=auth(),
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "mask"


def test_decompression_bombs_are_400_before_decoding(server: Server) -> None:
    out = io.BytesIO()
    Image.new("1", (20000, 20000)).save(out, format="PNG")  # 400 megapixels in a small file
    files = {"image": ("bomb.png", out.getvalue(), "image/png")}
    response = httpx.post(server.url + "/v1/images/edits", data={"prompt": "x"}, files=files, headers=auth(),
                          timeout=60)
    assert response.status_code == 400 and "megapixels" in response.json()["error"]["message"]


def test_the_api_key_is_required_and_checked(server: Server) -> None:
    body = {"prompt": "a fox", "size": "32x32"}
    missing = httpx.post(server.url + "/v1/images/generations", json=body, timeout=30)
    wrong = httpx.post(server.url + "/v1/images/generations", json=body, timeout=30,
                       headers={"Authorization": "Bearer " + KEY[:-1] + "x"})
    assert missing.status_code == wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 401
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).images.generate(prompt="a fox")


@pytest.mark.parametrize("flags, line", [
    (["--host", "0.0.0.0"], "error: --host 0.0.0.0 is not a loopback address: serving beyond this machine needs an "
                            "API key (--api-key, or FLUX2KLEIN_API_KEY), which every request must then carry"),
    # The one size rule at the model's multiple, before anything loads: what generate says of --width 40.
    (["--warm", "40x32"], "error: --warm size 40x32: width 40 is not a multiple of 16; use 32 or 48"),
], ids=["host", "warm"])
def test_options_a_server_cannot_take_are_exit_2_before_loading(flags: list[str], line: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLUX2KLEIN_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "serve", "--model", "tiny", *flags],
                          capture_output=True, text=True, timeout=120, env={**env, "FLUX2KLEIN_CACHE": str(tmp_path)})
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [line]), done.stderr


# ----------------------------------------------------------------------------- jobs, metrics, load


def test_jobs_queue_read_and_refuse_to_cancel_a_finished_job(server: Server) -> None:
    created = httpx.post(server.url + "/v1/jobs", json={"prompt": "a fox", "size": "32x32"}, headers=auth(),
                         timeout=30)
    assert created.status_code == 202
    job = created.json()
    assert job["status"] in ("queued", "running", "succeeded") and job["id"].startswith("job-")
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = httpx.get(f"{server.url}/v1/jobs/{job['id']}", headers=auth(), timeout=30).json()
    assert job["status"] == "succeeded" and png(job["data"][0]["b64_json"]).size == (32, 32)
    again = httpx.delete(f"{server.url}/v1/jobs/{job['id']}", headers=auth(), timeout=30)
    assert again.status_code == 409
    assert httpx.get(server.url + "/v1/jobs/job-nope", headers=auth(), timeout=30).status_code == 404


def metric_values(server: Server) -> dict[str, float]:
    """The server's /metrics samples by name and labels, as written."""
    text = httpx.get(server.url + "/metrics", headers=auth(), timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.mark.slow
def test_bounded_load_loses_no_request(server: Server) -> None:
    """200 requests, 16 at a time, against a queue of 16: each gets its image or an explicit 429
    with Retry-After, and the batcher ran some of them together."""

    def one(i: int) -> int:
        response = post(server, {"prompt": f"load {i}", "size": "32x32", "seed": i})
        if response.status_code == 200:
            assert png(response.json()["data"][0]["b64_json"]).size == (32, 32)
        else:
            assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1, response.text
        return response.status_code

    before = metric_values(server)
    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(one, range(200), timeout=240))
    assert len(codes) == 200 and set(codes) <= {200, 429} and codes.count(200) > 0
    assert time.monotonic() - start < 240
    after = metric_values(server)
    # Every answer is accounted for: one image per 200, one queue_full error per 429.
    assert after["flux2klein_images_total"] - before["flux2klein_images_total"] == codes.count(200)
    queue_full = 'flux2klein_errors_total{kind="queue_full"}'
    assert after.get(queue_full, 0) - before.get(queue_full, 0) == codes.count(429)
    metrics = httpx.get(server.url + "/metrics", headers=auth(), timeout=30).text
    assert 'flux2klein_batch_images_bucket{le="2.0"}' in metrics
    count = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("flux2klein_batch_images_count")))
    total = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("flux2klein_batch_images_sum")))
    assert total > count  # some batches held two requests
    assert "flux2klein_programs_compiled" in metrics and "flux2klein_queue_depth" in metrics


# ----------------------------------------------------------------------------- 429 and the drain


@pytest.mark.slow
def test_queue_full_is_429_and_sigterm_drains(tmp_path: Path) -> None:
    """A queue of one holding a job that waits a minute for company: a request is 429 with Retry-After;
    SIGTERM ends the window, runs the job and exits 0 (test_batcher.py checks the drain's steps)."""
    drained = start(tmp_path, "--queue", "1", "--batch-wait-ms", "60000", "--drain-timeout", "60")
    try:
        job = httpx.post(drained.url + "/v1/jobs", json={"prompt": "queued", "size": "32x32"}, timeout=30)
        assert job.status_code == 202, job.text  # queued when answered
        second = post(drained, {"prompt": "one too many", "size": "32x32"})
        assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1, second.text
        drained.process.send_signal(signal.SIGTERM)
        assert drained.process.wait(timeout=120) == 0, drained.stderr()
        assert "draining: 1 request(s) in flight" in drained.stderr() and "drain timeout" not in drained.stderr()
    finally:
        drained.stop()
