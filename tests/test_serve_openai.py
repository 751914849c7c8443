"""`flux2klein serve` as today's OpenAI clients call it (issue 42): the official `openai` client
(each output format, streaming with partial images, edits with several images and a mask), the
requests Open WebUI sends, a client that goes away, jobs cancelled while they run, and LoRA sets
picked per request without a compile.

One server (`tiny`, fp32, 127.0.0.1 on a free port, the session's executable store) for the
module; every request goes to it alone, with timeouts, and every wait is bounded.
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.fixtures.images import assert_same_seed_image
from tests.test_serve import KEY, Server, auth, client, metric_values, start

pytestmark = pytest.mark.slow  # a server of its own; a few shapes compile on a shared CPU
PROMPT = "a red fox in snow"
SEQUENCE = 32  # the servers' --max-sequence-length (tests/test_serve.py BASE_FLAGS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the server's folder, the `tiny` snapshot in its cache, a LoRA of transformer and text encoder)."""
    from flux2klein_cli.core.hub.snapshot import ensure_tiny
    from flux2klein_cli.core.lora.random_lora import write_random_lora

    root = tmp_path_factory.mktemp("serve-openai")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLUX2KLEIN_CACHE", str(root / "cache"))  # where start() points the server
        snapshot = ensure_tiny()
    lora = write_random_lora(root / "style.safetensors", snapshot / "transformer", "peft", rank=2, seed=3, std=0.5,
                             text_encoder_dir=snapshot / "text_encoder")
    return root, snapshot, lora


@pytest.fixture(scope="module")
def server(tiny: tuple[Path, Path, Path]) -> Iterator[Server]:
    root, _, lora = tiny
    running = start(root, "--lora-set", f"style={lora}:0.8", env={"FLUX2KLEIN_API_KEY": KEY})
    yield running
    running.stop()


def decoded(data: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


def pixels(data: str) -> np.ndarray:
    return np.asarray(decoded(data).convert("RGB"))


def encoded(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def text_tokens(snapshot: Path, prompt: str) -> int:
    from flux2klein_cli.core.pipeline.prompt_tokenizer import PromptTokenizer

    return int(PromptTokenizer(snapshot / "tokenizer")([prompt], SEQUENCE)[1].sum())


# ----------------------------------------------------------------------------- the openai client


def test_each_output_format_with_its_fields_and_usage(server: Server, tiny: tuple[Path, Path, Path]) -> None:
    answers = {fmt: client(server).images.generate(model="tiny", prompt=PROMPT, size="32x32", output_format=fmt,
                                                   extra_body={"seed": 5}) for fmt in ("png", "jpeg", "webp")}
    for fmt, answer in answers.items():
        image = decoded(answer.data[0].b64_json)
        assert (image.format, image.size, image.mode) == ({"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt],
                                                          (32, 32), "RGB")
        assert (answer.output_format, answer.size, answer.background, answer.quality) == (fmt, "32x32", "opaque",
                                                                                          "high")
    png = pixels(answers["png"].data[0].b64_json)
    for lossy in ("jpeg", "webp"):  # the same image, encoded with loss
        assert np.abs(pixels(answers[lossy].data[0].b64_json).astype(int) - png).mean() < 40
    small = client(server).images.generate(prompt=PROMPT, size="32x32", output_format="jpeg", output_compression=5,
                                           extra_body={"seed": 5})
    assert len(base64.b64decode(small.data[0].b64_json)) < len(base64.b64decode(answers["jpeg"].data[0].b64_json))

    usage = answers["png"].usage  # prompt tokens as the model's tokenizer counts them; 2x2 latent tokens out
    words = text_tokens(tiny[1], PROMPT)
    assert (usage.input_tokens_details.text_tokens, usage.input_tokens_details.image_tokens) == (words, 0)
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (words, 4, words + 4)
    # `quality` leaves a distilled model's steps alone; `size=auto` is its default size.
    low = client(server).images.generate(prompt=PROMPT, size="32x32", quality="low", n=2, extra_body={"seed": 5})
    assert_same_seed_image(png, pixels(low.data[0].b64_json))
    assert low.usage.output_tokens == 8
    auto = client(server).images.generate(prompt=PROMPT, size="auto", extra_body={"steps": 1})
    assert auto.size == "256x256" and decoded(auto.data[0].b64_json).size == (256, 256)


def test_streaming_sends_partial_images_then_the_image(server: Server) -> None:
    events = list(client(server).images.generate(prompt=PROMPT, size="32x32", stream=True, partial_images=2,
                                                 extra_body={"seed": 7}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(decoded(e.b64_json).size == (32, 32) for e in events)
    whole = client(server).images.generate(prompt=PROMPT, size="32x32", extra_body={"seed": 7})
    assert np.array_equal(pixels(events[-1].b64_json), pixels(whole.data[0].b64_json))  # chunks change nothing
    assert not np.array_equal(pixels(events[0].b64_json), pixels(whole.data[0].b64_json))  # after 1 of 4 steps
    assert events[-1].usage.output_tokens == 4 and events[-1].size == "32x32"
    edit = list(client(server).images.edit(image=("a.png", encoded(Image.new("RGB", (64, 64), (9, 99, 199))),
                                                  "image/png"), prompt="blue", stream=True, partial_images=1))
    assert [e.type for e in edit] == ["image_edit.partial_image", "image_edit.completed"]


def test_an_edit_takes_several_images_and_a_mask(server: Server) -> None:
    init = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8))
    rgba = np.full((64, 64, 4), 255, np.uint8)
    rgba[16:48, 16:48, 3] = 0  # transparent: repaint
    mask = ("mask.png", encoded(Image.fromarray(rgba, "RGBA")), "image/png")

    def edit(second: Image.Image) -> openai.types.ImagesResponse:
        return client(server).images.edit(
            image=[("init.png", encoded(init), "image/png"), ("ref.png", encoded(second), "image/png")], mask=mask,
            prompt="a blue ball", input_fidelity="high", extra_body={"seed": 2, "steps": 2})

    red, green = edit(Image.new("RGB", (64, 64), (220, 20, 20))), edit(Image.new("RGB", (64, 64), (20, 220, 20)))
    assert red.size == "64x64" and red.usage.input_tokens_details.image_tokens == 2 * 16  # init + reference
    a, b = pixels(red.data[0].b64_json), pixels(green.data[0].b64_json)
    assert not np.array_equal(a, b)  # the second image conditions the edit
    keep = rgba[..., 3] == 255
    assert np.abs(a[keep].astype(int) - np.asarray(init)[keep]).mean() < np.abs(a[~keep].astype(int)
                                                                                - np.asarray(init)[~keep]).mean()


# ----------------------------------------------------------------------------- Open WebUI


def test_what_open_webui_posts(server: Server) -> None:
    """Open WebUI's OpenAI engine posts {model, prompt, n, size, response_format} to BASE/images/generations
    (no response_format for gpt-image models: b64 by default), and edits as multipart with image[] files."""
    for base in (server.url + "/v1", server.url):  # a base URL with or without /v1
        for extra in ({"response_format": "b64_json"}, {}):
            answer = httpx.post(f"{base}/images/generations", headers={**auth(), "Content-Type": "application/json"},
                                json={"model": "tiny", "prompt": PROMPT, "n": 1, "size": "32x32", **extra}, timeout=120)
            assert answer.status_code == 200, answer.text
            assert decoded(answer.json()["data"][0]["b64_json"]).format == "PNG"
    files = [("image[]", (f"{i}.png", encoded(Image.new("RGB", (64, 64), (40 * i, 90, 9))), "image/png"))
             for i in range(2)]
    data = {"model": "tiny", "prompt": "make it blue", "n": "1", "size": "32x32", "response_format": "b64_json"}
    answer = httpx.post(server.url + "/v1/images/edits", headers=auth(), data=data, files=files, timeout=120)
    assert answer.status_code == 200, answer.text
    assert decoded(answer.json()["data"][0]["b64_json"]).size == (32, 32)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"background": "transparent"}, "background", "no alpha"),
    ({"output_format": "gif"}, "output_format", "png, jpeg, webp"),
    ({"output_compression": 101}, "output_compression", "between 0 and 100"),
    ({"stream": True, "partial_images": 4}, "partial_images", "between 0 and 3"),
    ({"partial_images": 1}, "partial_images", "stream"),
    ({"quality": "ultra"}, "quality", "low, medium, high, auto"),
    ({"n": 11}, "n", "at most 10"),
    ({"model": "tiny+nope"}, "lora_set", "style"),
    ({"model": "tiny+style", "lora_set": "other"}, "lora_set", "give one"),
    ({"style": "vivid"}, "style", "not a field"),
])
def test_fields_without_a_meaning_here_are_400_naming_the_param(server: Server, body: dict, param: str,
                                                                words: str) -> None:
    answer = httpx.post(server.url + "/v1/images/generations", json={"prompt": "x", "size": "32x32", **body},
                        headers=auth(), timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error") and words in error["message"], error


# ----------------------------------------------------------------------------- cancelling


def wait_for(condition: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.1)


def test_a_client_that_goes_away_and_a_cancelled_job_stop_their_runs(server: Server) -> None:
    """1000 steps in chunks: the stream is closed after its first partial image, and the job is
    cancelled once it reports progress; each run then stops at a chunk (a batch stopped, counted)."""
    stopped = "flux2klein_batches_stopped_total"
    before = metric_values(server).get(stopped, 0)
    body = {"prompt": "slow", "size": "32x32", "steps": 1000, "stream": True, "partial_images": 3}
    with httpx.stream("POST", server.url + "/v1/images/generations", json=body, headers=auth(), timeout=300) as sent:
        first = next(line for line in sent.iter_lines() if line.startswith("event:"))
    assert first == "event: image_generation.partial_image"
    wait_for(lambda: metric_values(server).get(stopped, 0) == before + 1, "the stream's run stopped")

    job = httpx.post(server.url + "/v1/jobs", json={"prompt": "slow", "size": "32x32", "steps": 1000},
                     headers=auth(), timeout=30).json()
    read = lambda: httpx.get(f"{server.url}/v1/jobs/{job['id']}", headers=auth(), timeout=30).json()  # noqa: E731
    wait_for(lambda: "progress" in read(), "the job reports progress")
    progress = read()["progress"]
    assert progress["steps"] == 1000 and 0 < progress["step"] < 1000
    cancelled = httpx.post(f"{server.url}/v1/jobs/{job['id']}/cancel", headers=auth(), timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert read()["error"]["code"] == "cancelled"
    wait_for(lambda: metric_values(server).get(stopped, 0) == before + 2, "the job's run stopped")
    again = httpx.post(f"{server.url}/v1/jobs/{job['id']}/cancel", headers=auth(), timeout=30)
    assert again.status_code == 409


# ----------------------------------------------------------------------------- LoRA sets


def test_a_lora_set_is_picked_by_model_or_field_and_compiles_nothing(server: Server) -> None:
    names = [m.id for m in client(server).models.list().data]
    assert names == ["tiny", "tiny+style"]

    def image(model: str = "tiny", **extra: object) -> np.ndarray:
        answer = client(server).images.generate(prompt=PROMPT, model=model, size="32x32",
                                                extra_body={"seed": 9, **extra})
        return pixels(answer.data[0].b64_json)

    base = image()
    compiled = metric_values(server)["flux2klein_programs_compiled"]
    by_model, by_field = image("tiny+style"), image(lora_set="style")
    assert np.array_equal(by_model, by_field) and not np.array_equal(by_model, base)
    assert np.array_equal(image(), base)  # and back
    assert metric_values(server)["flux2klein_programs_compiled"] == compiled


class CompileLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Compiling") or "XLA compilation" in record.getMessage():
            self.compiled.append(record.getMessage()[:120])


def test_switching_lora_sets_compiles_nothing_and_equals_merging_at_load(tiny: tuple[Path, Path, Path]) -> None:
    """In one process, JAX's own compile log: after a shape's first run, runs that switch between the
    base weights and a set compile nothing at all; the set's image equals one from an engine with the
    same LoRA merged at load (`--lora`)."""
    import jax
    from flax import nnx

    from flux2klein_cli.core.engine.engine import Engine, EngineOptions
    from flux2klein_cli.core.engine.plan import RunFields

    _, snapshot, lora = tiny
    spec = f"{lora}:0.8"
    engine = Engine.load(EngineOptions(model=str(snapshot), dtype="fp32", store=False, lora_sets=(("style", (spec,)),)),
                         snapshot, warn=lambda message: None)
    fields = RunFields(prompts=(PROMPT,), height=32, width=32, seed=4, max_sequence_length=SEQUENCE)
    base = engine.run(engine.plan(fields)).images
    log = CompileLog()
    logging.getLogger("jax").addHandler(log)
    jax.config.update("jax_log_compiles", True)
    try:
        styled = engine.run(engine.plan(RunFields(**{**fields.__dict__, "lora_set": "style"}))).images
        again = engine.run(engine.plan(fields)).images
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(log)
    assert log.compiled == []
    assert np.array_equal(again, base) and not np.array_equal(styled, base)
    merged = Engine.load(EngineOptions(model=str(snapshot), dtype="fp32", store=False, lora=(spec,)), snapshot,
                         warn=lambda message: None)
    np.testing.assert_array_equal(merged.run(merged.plan(fields)).images, styled)
    # What the set leaves alone (the text encoder's norms, its embedding) is the base weights' own arrays.
    own, base_text = (dict(nnx.to_flat_state(engine.weight_sets[name].text_encoder)) for name in ("style", None))
    shared = {path for path, var in own.items() if var.get_value() is base_text[path].get_value()}
    assert shared and len(shared) < len(own)
    assert engine.lora_set_records["style"][0]["scale"] == 0.8


def test_partial_images_spread_over_the_steps_and_quality_sets_a_base_models_steps() -> None:
    from flux2klein_cli.core.serve.service import partial_schedule, run_fields

    assert partial_schedule(4, 1) == (2, (2,))
    assert partial_schedule(4, 3) == (1, (1, 2, 3))
    assert partial_schedule(50, 3) == (10, (10, 20, 40))  # five calls of ten steps: three of their ends
    assert partial_schedule(2, 3) == (1, (1,))  # no more partial images than steps before the last
    steps = {q: run_fields({"prompt": "x", "quality": q}, (), 32, distilled=False).steps
             for q in ("low", "medium", "high", "auto")}
    assert steps == {"low": 13, "medium": 25, "high": 50, "auto": None}
    assert run_fields({"prompt": "x", "quality": "low"}, (), 32, distilled=True).steps is None
