"""Every limit of the table (core/limits.py) at its bound + 1, fed to each command that takes that
input: the same exit-2 line from each (the flag spelled as that command spells it), refused
before anything loads or is written. `convert` takes none of these inputs (no prompt, size,
steps or seed: it rewrites weights), so it has no row here."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.limits import LIMITS

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

runner = CliRunner()
RUNS = ("generate", "edit")  # a prompt, an output, the whole plan
SHAPES = ("compile", "bench")  # a run's shape: --bs for its images, --refs for its references

# limit -> (arguments, commands that take them, the expected line with {flag} for the command's spelling)
OVER = LIMITS.max_pixels // 8192 + 16
CASES = {
    "steps": (["--steps", str(LIMITS.steps + 1)], RUNS + SHAPES,
              f"--steps must be at most {LIMITS.steps}, got {LIMITS.steps + 1}"),
    "side": (["--height", str(LIMITS.max_side + 16)], RUNS + SHAPES,
             f"--height must be at most {LIMITS.max_side} px, got {LIMITS.max_side + 16}"),
    "pixels": (["--height", "8192", "--width", str(OVER)], RUNS + SHAPES,
               f"--width x --height is {OVER}x8192 = {OVER * 8192} px; the limit is {LIMITS.max_pixels} px "
               "(8192x8192)"),
    "images": (["{flag}", str(LIMITS.images + 1)], RUNS + SHAPES,
               f"{{flag}} must be at most {LIMITS.images} images per run (prompts x images), got {LIMITS.images + 1}"),
    "seed": (["--seed", str(LIMITS.seed_end)], RUNS,
             f"--seed must be at most {LIMITS.seed_end - 1}, got {LIMITS.seed_end}"),
    "seed+images": (["--seed", str(LIMITS.seed_end - 1), "-n", "2"], RUNS,
                    f"--seed + image index must stay below 2**32 ({LIMITS.seed_end}), got {LIMITS.seed_end} "
                    f"(seed {LIMITS.seed_end - 1}, 2 images)"),
    "guidance": (["--guidance", str(LIMITS.guidance + 0.5)], (*RUNS, "compile"),
                 f"--guidance must be between 0 and {LIMITS.guidance:g}, got {LIMITS.guidance + 0.5:g}"),
    "max-sequence-length": (["--max-sequence-length", str(LIMITS.prompt_tokens + 1)], (*RUNS, "compile"),
                            f"--max-sequence-length must be at most {LIMITS.prompt_tokens} tokens, "
                            f"got {LIMITS.prompt_tokens + 1}"),
    "references": (["{references}"], ("edit", *SHAPES), f"{{refs}} gives {LIMITS.references + 1} reference images; "
                                                         f"at most {LIMITS.references} are supported"),
    "prompt bytes": (["--prompt-file", "{long_prompt}"], RUNS,
                     f"PROMPT is {LIMITS.prompt_bytes + 1} bytes; the limit is {LIMITS.prompt_bytes} bytes"),
    "prompt file": (["--prompt-file", "{big_file}"], RUNS,
                    f"prompt file {{big_file}} is larger than the limit of {LIMITS.prompt_file_bytes // 2**20} MiB"),
}
IMAGE_FLAG = {"generate": "-n", "edit": "-n", "compile": "--bs", "bench": "--bs"}
SPELLED = {"generate": "--num-images", "edit": "--num-images", "compile": "--bs", "bench": "--bs"}
REFS = {"edit": "--image", "compile": "--refs", "bench": "--refs"}  # where a command takes its references


def _params() -> list[object]:
    out = []
    for name, (_, commands, _) in CASES.items():
        for command in commands:
            out.append(pytest.param(name, command, id=f"{name}-{command}"))
    return out


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, str]:
    image = tmp_path / "a.png"
    Image.new("RGB", (64, 64), (90, 120, 150)).save(image)
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_bytes(b"x" * (LIMITS.prompt_bytes + 1))
    big_file = tmp_path / "big.txt"
    big_file.write_bytes(b"a fox\n" * (LIMITS.prompt_file_bytes // 6 + 1))
    return {"image": str(image), "long_prompt": str(long_prompt), "big_file": str(big_file)}


def _argv(name: str, command: str, inputs: dict[str, str], out: Path) -> list[str]:
    args, _, _ = CASES[name]
    argv = []
    for arg in args:
        if arg == "{flag}":
            argv.append(IMAGE_FLAG[command])
        elif arg == "{references}":
            count = LIMITS.references + 1
            argv += (["--image", inputs["image"]] * count if command == "edit" else ["--refs", str(count)])
        else:
            argv.append(arg.format(**inputs))
    head = [command]
    if command in RUNS:
        if "--prompt-file" not in argv:
            head.append("a fox")
        if command == "edit" and name != "references":
            head += ["--image", inputs["image"]]
        head += ["-o", str(out / "x.png")]
    return [*head, "--model", "tiny", *argv]


@pytest.mark.parametrize("name, command", _params())
def test_a_limit_plus_one_is_the_same_line_everywhere(name: str, command: str, inputs: dict[str, str],
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(cache))
    monkeypatch.setenv("FLUX2KLEIN_COMPILE_CACHE", str(tmp_path / "store"))
    done = runner.invoke(app, _argv(name, command, inputs, out))
    expected = CASES[name][2].format(flag=SPELLED[command], refs=REFS.get(command), **inputs)
    assert (done.exit_code, done.stderr.splitlines()) == (2, [f"error: {expected}"])
    # Refused before any model work: no output, no executable store (the `tiny` alias may have
    # written its checkpoint into the cache: its configs are the model's facts).
    assert list(out.iterdir()) == [] and not (tmp_path / "store").exists()
