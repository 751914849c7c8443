"""Prompt -> token ids, as `Qwen2TokenizerFast` + `apply_chat_template` give them, without transformers.

Importing transformers' tokenizer machinery costs several seconds of a cold start; the
`tokenizers` library (the same Rust BPE that backs the fast tokenizer) and a Jinja
environment configured as transformers configures it give the same ids in milliseconds.
A test checks the ids against transformers on the same files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.configs import read_json


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict[str, Any]) -> str:
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise CheckpointError(f"{directory}: no chat template (chat_template.jinja or tokenizer_config.json)")
    return template


def _compile(template: str) -> Any:
    """The template in a sandbox with transformers' settings and helpers, so it renders the same text."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class PromptTokenizer:
    """One user message, generation prompt, thinking off; padded and truncated on the right."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        config = read_json(directory / "tokenizer_config.json")
        try:
            self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # the Rust library raises its own exception type
            raise CheckpointError(f"{directory / 'tokenizer.json'}: cannot load tokenizer ({e})") from None
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token",
                                                                          "unk_token")}
        pad = self.special["pad_token"]
        self.pad_id = self.tokenizer.token_to_id(pad) if pad else None
        if self.pad_id is None:
            raise CheckpointError(f"{directory}: tokenizer has no pad token (needed to pad prompts)")
        if config.get("padding_side", "right") != "right" or config.get("truncation_side", "right") != "right":
            raise CheckpointError(f"{directory}: only right padding and truncation are supported")
        self.template = _compile(_chat_template(directory, config))

    def render(self, prompt: str) -> str:
        return self.template.render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, enable_thinking=False,
            **{k: v for k, v in self.special.items() if v is not None},
        )

    def __call__(self, prompts: Sequence[str], max_length: int = DEFAULTS.max_sequence_length
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(B, max_length) int32 ids and attention mask."""
        encodings = self.tokenizer.encode_batch([self.render(p) for p in prompts], add_special_tokens=True)
        ids = np.full((len(prompts), max_length), self.pad_id, np.int32)
        mask = np.zeros((len(prompts), max_length), np.int32)
        for row, encoding in enumerate(encodings):
            kept = encoding.ids[:max_length]
            ids[row, : len(kept)] = kept
            mask[row, : len(kept)] = 1
        return ids, mask
