"""`bench`'s rules between options live in core (BenchOptions.check), checked before any model is read."""

from __future__ import annotations

import dataclasses

import pytest

from flux2klein_cli.core.choices import PHASES
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.runs.bench.run import PHASE_FLAGS, BenchOptions

# One value per flag that makes it "given".
GIVEN = {"--diffusers": {"diffusers": True}, "--mesh": {"mesh": "fsdp=1"}, "--tpu": {"tpu": "v6-4"},
         "--compile-cache": {"compile_cache": "x"}, "--no-save": {"save": False}, "--effort": {"effort": "fast"},
         "--no-store": {"store": False}, "--lora": {"lora": ("a.safetensors",)}, "--ranks": {"ranks": "4"},
         "--refs": {"refs": "1"}}


def test_the_defaults_and_every_phase_alone_pass() -> None:
    for phase in PHASES:
        BenchOptions(phase=phase, model="not-read-by-the-check").check()


@pytest.mark.parametrize("phase, flag", [(phase, flag) for only, flags in PHASE_FLAGS.items() for flag in flags
                                         for phase in PHASES if phase != only])
def test_a_phase_flag_with_another_phase_is_exit_2(phase: str, flag: str) -> None:
    opts = dataclasses.replace(BenchOptions(phase=phase), **GIVEN[flag])
    with pytest.raises(UserInputError, match=f"^{flag}: only with --phase ") as caught:
        opts.check()
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("changes, message", [
    ({"refs": "5"}, "references gives 5 reference images; at most 4 are supported"),
    ({"refs": "-1"}, "--refs: '-1' is neither a count nor HEIGHTxWIDTH"),
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
def test_rules_between_options(changes: dict[str, object], message: str) -> None:
    with pytest.raises(UserInputError, match=message):
        dataclasses.replace(BenchOptions(), **changes).check()


def test_a_kv_edit_with_references_passes() -> None:
    BenchOptions(kv=True, refs="4").check()
    BenchOptions(kv=True, refs="512x512,768x1024").check()
