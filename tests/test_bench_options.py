"""`bench`'s rules between options live in core (BenchOptions.check), checked before any model is read."""

from __future__ import annotations

import dataclasses

import pytest

from flux2klein_cli.cli.flags import SHAPE_FLAGS, message
from flux2klein_cli.core.choices import PHASES
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.fields import flag
from flux2klein_cli.core.runs.bench.run import PHASE_FIELDS, BenchOptions

# One value per field that makes it "given".
GIVEN = {"diffusers": {"diffusers": True}, "mesh": {"mesh": "fsdp=1"}, "tpu": {"tpu": "v6-4"},
         "compile_cache": {"compile_cache": "x"}, "no_save": {"save": False}, "effort": {"effort": "fast"},
         "no_store": {"store": False}, "lora": {"lora": ("a.safetensors",)}, "ranks": {"ranks": "4"},
         "refs": {"refs": "1"}, "cache": {"cache": (("cache", "fbcache"),)}}


def test_the_defaults_and_every_phase_alone_pass() -> None:
    for phase in PHASES:
        BenchOptions(phase=phase, model="not-read-by-the-check").check()


@pytest.mark.parametrize("phase, name", [(phase, name) for only, names in PHASE_FIELDS.items() for name in names
                                         for phase in PHASES if phase != only])
def test_a_phase_flag_with_another_phase_is_exit_2(phase: str, name: str) -> None:
    opts = dataclasses.replace(BenchOptions(phase=phase), **GIVEN[name])
    with pytest.raises(UserInputError) as caught:
        opts.check()
    assert message(caught.value, SHAPE_FLAGS).startswith(f"{flag(name)}: only with --phase ")
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("changes, words", [
    ({"refs": "5"}, "--refs gives 5 reference images; at most 4 are supported"),
    ({"refs": "-1"}, "--refs '-1' is neither a count nor HEIGHTxWIDTH"),
    ({"kv": True}, "--kv times edits"),
    ({"kv": True, "refs": "0"}, "--kv times edits"),
    ({"kv": True, "phase": "decode"}, "--kv times edits"),
    ({"batch": 0}, "--bs, --reps and --steps must be at least 1"),
    ({"steps": 0}, "--bs, --reps and --steps must be at least 1"),
    ({"height": 0}, "height"),
    ({"store": False, "save": False}, "--no-store uses no executable store: drop --no-save"),
    ({"store": False, "effort": "fast", "compile_cache": "x"},
     "--no-store uses no executable store: drop --compile-cache and --effort"),
    ({"phase": "warm"}, "unknown phase"),
])
def test_rules_between_options(changes: dict[str, object], words: str) -> None:
    with pytest.raises(UserInputError) as caught:
        dataclasses.replace(BenchOptions(), **changes).check()
    assert words in message(caught.value, SHAPE_FLAGS)


def test_a_kv_edit_with_references_passes_on_a_kv_model_only() -> None:
    BenchOptions(model="9b-kv", kv=True, refs="4").check()
    BenchOptions(model="9b-kv", kv=True, refs="512x512,768x1024").check()
    with pytest.raises(UserInputError, match="needs a KV-trained checkpoint"):  # the plan's rule, before any load
        BenchOptions(model="4b", kv=True, refs="4").check()
