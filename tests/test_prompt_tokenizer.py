"""The transformers-free prompt tokenizer gives the ids of Qwen2TokenizerFast + apply_chat_template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.models.qwen3 import encode_prompts
from flux2klein_cli.core.pipeline.prompt_tokenizer import PromptTokenizer

PROMPTS = [
    "a red fox in snow",
    "A lighthouse at dawn, oil painting; 35mm, f/1.8 -- \"dramatic\" light!",
    "Ünïcödé café 東京 🦊 and tabs\tand\nnewlines",
    "text that mentions <|im_end|> and <think> tags",
    " leading and trailing spaces ",
    "word " * 300,  # longer than max_length: truncated on the right
]


@pytest.mark.parametrize("max_length", [512, 64])
def test_same_ids_and_mask_as_transformers(tiny_checkpoint: Path, max_length: int) -> None:
    folder = tiny_checkpoint / "tokenizer"
    ours = PromptTokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    assert ours.render(PROMPTS[0]) == reference.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    ids, mask = ours(PROMPTS, max_length)
    ref_ids, ref_mask = encode_prompts(reference, PROMPTS, max_length=max_length)
    assert ids.shape == (len(PROMPTS), max_length) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert mask[-1].all() and not mask[0].all()  # one truncated, one padded


def test_missing_tokenizer_file_is_a_checkpoint_error(tiny_checkpoint: Path, tmp_path: Path) -> None:
    config = (tiny_checkpoint / "tokenizer" / "tokenizer_config.json").read_text()
    (tmp_path / "tokenizer_config.json").write_text(config)
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        PromptTokenizer(tmp_path)


REAL_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja"


@pytest.fixture
def real_template_tokenizer(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """The fixture's tokenizer with Qwen3's own chat template in tokenizer_config.json, as the
    FLUX.2 [klein] tokenizer folders ship it (the full template: tools, thinking, indentation)."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(tiny_checkpoint / "tokenizer", folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = REAL_TEMPLATE.read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_qwen3s_own_template_renders_as_transformers_renders_it(real_template_tokenizer: Path,
                                                                tiny_checkpoint: Path) -> None:
    ours = PromptTokenizer(real_template_tokenizer)
    reference = AutoTokenizer.from_pretrained(real_template_tokenizer)
    for prompt in PROMPTS:
        assert ours.render(prompt) == reference.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    # What FLUX.2 [klein] encodes, and what the fixture's short template renders too.
    expected = "<|im_start|>user\na red fox in snow<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ours.render(PROMPTS[0]) == expected == PromptTokenizer(tiny_checkpoint / "tokenizer").render(PROMPTS[0])
    ids, mask = ours(PROMPTS, 64)
    ref_ids, ref_mask = encode_prompts(reference, PROMPTS, max_length=64)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
