"""`batch` manifests with `init_image`, `mask`, `strength` (image-to-image and inpainting): paths
relative to the manifest, the files' content in each item's hash, conditioning kept apart by the
batch key, and a line's PNG equal to `edit --init-image --mask` with the same seed, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.engine.plan import model_facts
from flux2klein_cli.core.runs.batch import grouping, manifest
from tests.test_batch import DEADLINE_S, DEFAULTS, _cli, _pixels, env  # noqa: F401 (env: a fixture)


def _images(folder: Path) -> None:
    y, x = np.mgrid[0:64, 0:80]
    Image.fromarray(np.stack([x * 3, y * 4, np.full_like(x, 90)], -1).astype(np.uint8)).save(folder / "init.png")
    mask = np.zeros((64, 80), np.uint8)
    mask[8:40, 20:60] = 255
    Image.fromarray(mask).save(folder / "mask.png")


def test_conditioning_fields_read_relative_to_the_manifest(tmp_path: Path) -> None:
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text('{"prompt": "a", "init_image": "in/init.png", "mask": "in/mask.png", "strength": 0.5}\n'
                     '{"prompt": "b", "init_image": "/abs/init.png", "reference_max_area": 65536}\n'
                     '{"prompt": "c", "strength": true}\n{"prompt": "d", "mask": ""}\n')
    csv = tmp_path / "m.csv"
    csv.write_text("prompt,init_image,mask,strength\na, in/init.png ,in/mask.png,0.5\n")
    a, b, bad_strength, bad_mask = manifest.read_manifest(jsonl, DEFAULTS).entries
    (csv_a,) = manifest.read_manifest(csv, DEFAULTS).entries
    for entry in (a, csv_a):
        assert entry.fields.init_image == tmp_path / "in/init.png" and entry.fields.mask == tmp_path / "in/mask.png"
        assert entry.fields.strength == 0.5
    assert b.fields.init_image == Path("/abs/init.png") and b.fields.reference_max_area == 65536
    assert "strength must be a finite number" in bad_strength.error
    assert "mask must be a file name" in bad_mask.error


def test_the_hash_takes_the_files_content_and_the_key_the_conditioning(tmp_path: Path) -> None:
    _images(tmp_path)
    facts = model_facts("tiny")
    path = tmp_path / "m.jsonl"
    lines = [{"prompt": "a", "init_image": "init.png", "mask": "mask.png", "strength": 0.6},
             {"prompt": "b", "init_image": "init.png", "strength": 0.6},
             {"prompt": "c", "init_image": "init.png", "mask": "mask.png", "strength": 0.7},
             {"prompt": "d", "init_image": "init.png", "mask": "mask.png", "strength": 0.6},
             {"prompt": "e", "mask": "mask.png"}, {"prompt": "f", "init_image": "missing.png"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    defaults = DEFAULTS.__class__(prompts=(), steps=1, max_sequence_length=16)  # the init image sets the size

    def plan() -> tuple[list[grouping.Item], dict[int, str]]:
        items, bad = grouping.plan_items(manifest.read_manifest(path, defaults).entries, facts, {})
        return items, {e.line: e.error for e in bad}

    items, bad = plan()
    assert [i.entry.line for i in items] == [1, 2, 3, 4]
    assert "mask needs an init image (init_image)" in bad[5] and "missing.png does not exist" in bad[6]
    keys = [i.key for i in items]
    assert keys[0] == keys[3] and len({keys[0], keys[1], keys[2]}) == 3  # mask, no mask, another strength
    before = [i.digest for i in items]
    assert plan()[0][0].digest == before[0]
    mask = np.asarray(Image.open(tmp_path / "mask.png")).copy()
    mask[0, 0] = 255  # the same path, other content: a new request for the lines that read it
    Image.fromarray(mask).save(tmp_path / "mask.png")
    after = [i.digest for i in plan()[0]]
    assert after[1] == before[1] and all(after[i] != before[i] for i in (0, 2, 3))


@pytest.mark.slow
def test_an_inpaint_line_equals_edit_bit_for_bit(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    _images(tmp_path)
    small = ["--model", "tiny", "--steps", "2", "--max-sequence-length", "16"]
    lines = [{"prompt": "a red ball", "seed": 4, "init_image": "init.png", "mask": "mask.png", "strength": 0.7,
              "output": "inpaint.png"},
             {"prompt": "a red ball", "seed": 4, "init_image": "init.png", "strength": 0.7, "output": "img2img.png"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = _cli([tmp_path / "m.jsonl", "--out-dir", tmp_path / "out", "--bs", 2, "--json", *small], env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["ok"], report["batches"]) == (2, 2)  # the mask keys its line apart
    for name, extra in (("inpaint", ["--mask", tmp_path / "mask.png"]), ("img2img", [])):
        edit = subprocess.run([sys.executable, "-m", "flux2klein_cli", "edit", "a red ball", "--seed", "4",
                               "--init-image", str(tmp_path / "init.png"), *map(str, extra), "--strength", "0.7",
                               "-o", str(tmp_path / f"{name}-edit.png"), *small], env=env, capture_output=True,
                              text=True, timeout=DEADLINE_S)
        assert edit.returncode == 0, edit.stderr
        ours = _pixels(tmp_path / "out" / f"{name}.png")
        assert ours.shape == (64, 80, 3)
        np.testing.assert_array_equal(ours, _pixels(tmp_path / f"{name}-edit.png"))
        with Image.open(tmp_path / "out" / f"{name}.png") as png:
            assert png.text["init_image"] == str(tmp_path / "init.png") and float(png.text["strength"]) == 0.7
            assert png.text.get("mask") == (str(tmp_path / "mask.png") if extra else None)
    assert not np.array_equal(_pixels(tmp_path / "out/inpaint.png"), _pixels(tmp_path / "out/img2img.png"))
