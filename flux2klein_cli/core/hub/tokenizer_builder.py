"""A tiny Qwen-style tokenizer built from scratch, so tests and generated checkpoints need no download.

It has the same machinery as Qwen3's `Qwen2TokenizerFast` (NFC, the Qwen split regex,
byte-level BPE, `<|endoftext|>` padding, ChatML special tokens, a chat template that
honours `enable_thinking`), with a vocabulary of a few hundred tokens trained on a
small built-in corpus of image prompts. The files it writes are the same on every run.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# The pre-tokenisation regex of Qwen2/Qwen3 tokenizers (contractions, letter runs, single digits, ...).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# (content, special): as in Qwen3, the think tags are added tokens but not "special", so
# decoding with skip_special_tokens keeps them.
ADDED_TOKENS = ((PAD_TOKEN, True), (IM_START, True), (IM_END, True), ("<think>", False), ("</think>", False))

TARGET_VOCAB = 640

# ChatML with Qwen3's thinking switch: after the assistant header of a generation prompt,
# enable_thinking=False inserts an empty think block, which is what FLUX.2 klein encodes.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

CORPUS = """\
A photograph of a red fox sitting in fresh snow at dawn, soft golden light, shallow depth of field.
An astronaut riding a horse across a desert of orange sand under two moons, cinematic, wide angle.
A cozy wooden cabin in a pine forest, smoke rising from the chimney, warm windows, winter evening.
Portrait of an old fisherman with a grey beard and a blue knitted hat, dramatic side lighting, 85mm.
A bowl of ramen with a soft boiled egg, green onions and steam, top-down food photography.
Watercolor painting of a lighthouse on a rocky coast, crashing waves, seagulls, pastel colors.
A futuristic city skyline at night with neon signs, flying cars and rain reflecting on the streets.
A small robot watering plants in a greenhouse, isometric 3D render, bright and cheerful colors.
Oil painting of sunflowers in a clay vase on a wooden table, thick brush strokes, impressionist style.
A cat wearing sunglasses lying on a beach towel, summer, bright sunlight, vivid colors, 4k.
Macro shot of a dew drop on a spider web, morning light, bokeh background, extremely detailed.
An ancient library with tall shelves, floating candles and dust in the air, fantasy illustration.
A vintage red bicycle leaning against a yellow wall with flowers, film photo, grainy, 35mm.
Mountain lake reflecting snowy peaks at sunrise, mist over the water, landscape photography.
A dragon made of glass flying over a medieval castle, sparkling light, highly detailed digital art.
Close-up of a hummingbird drinking from a purple flower, frozen motion, sharp focus, nature photo.
A bustling street market in Marrakech with spices, lanterns and colorful fabrics, travel photography.
Minimalist poster of a whale swimming in a deep blue ocean, flat design, simple shapes, white text.
A steaming cup of coffee next to an open book and reading glasses on a rainy afternoon by the window.
Pixel art of a knight fighting a slime monster in a cave, 16-bit retro video game style.
Edit the image: change the color of the car to green and add snow on the roof.
Replace the background with a sunny beach, keep the person and the lighting the same.
Make it look like a pencil sketch, black and white, with cross hatching shadows.
Add a rainbow in the sky behind the mountains and make the grass greener.
Two dogs playing with a ball in a park, autumn leaves, golden hour, happy mood, 50mm lens.
A bright modern kitchen with white cabinets, marble counters and plants, interior design photo.
Children building a sandcastle at the seaside, long shadows, warm afternoon light, candid photo.
The text "OPEN 24 HOURS" glowing in pink neon above the door of a small diner at night.
A detailed map of a fantasy island with forests, rivers, villages and a volcano, parchment paper.
A snowy owl perched on a branch, falling snow, dark background, high contrast wildlife photo.
"""


def _train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        special_tokens=[],
    )
    # The chat framing is part of the corpus, so that "user", "assistant" and "\n\n" get tokens.
    lines = CORPUS.splitlines() + ["user\n", "assistant\n", "\n\n"] * 8
    tokenizer.train_from_iterator(lines, trainer=trainer)
    # Added after training, so they sit at the end of the vocabulary as in Qwen's.
    tokenizer.add_tokens(
        [AddedToken(t, special=s, normalized=False, lstrip=False, rstrip=False) for t, s in ADDED_TOKENS]
    )
    return tokenizer


def _tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(content)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(out_dir: Path) -> int:
    """Write tokenizer.json and tokenizer_config.json to `out_dir`; return the vocabulary size
    (BPE tokens plus the added special tokens) for the tiny Qwen3 config."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train()
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    config = _tokenizer_config(tokenizer)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tokenizer.get_vocab_size(with_added_tokens=True)
