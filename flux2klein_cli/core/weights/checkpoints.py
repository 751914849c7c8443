"""Open a component's weights, whatever file holds them: safetensors (diffusers' or BFL's keys,
sharded or not), one GGUF file, or one ComfyUI-format quantized safetensors file.

The one place that tells them apart: a `.gguf` file (or a component folder holding one) is GGUF;
a single safetensors file with `.comfy_quant` tensors (or ComfyUI's quantization metadata) is
ComfyUI's; anything else is read by SafetensorsCheckpoint. All three answer the same interface
(quantized_file.py says which).
"""

from __future__ import annotations

from pathlib import Path

from flux2klein_cli.core.weights.comfy_quant import is_comfy_quant, open_comfy
from flux2klein_cli.core.weights.gguf_file import SUFFIX, is_gguf, open_gguf
from flux2klein_cli.core.weights.quantized_file import QuantizedCheckpoint
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint, read_header, read_metadata

Checkpoint = SafetensorsCheckpoint | QuantizedCheckpoint


def quantized_file(path: str | Path) -> Path | None:
    """The one quantized file a component path is (or a component folder holds), else None."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob(f"*{SUFFIX}"))
        if found:
            return found[0].resolve()
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            return None
        path = files[0]
    if is_gguf(path):
        return path.resolve()
    if path.suffix == ".safetensors" and path.is_file() and is_comfy_quant(read_header(path), read_metadata(path)):
        return path.resolve()
    return None


def open_weights(path: str | Path) -> Checkpoint:
    """The weights of a component folder or of one weight file."""
    file = quantized_file(path)
    if file is None:
        return SafetensorsCheckpoint.open(path)
    return open_gguf(file) if is_gguf(file) else open_comfy(file)
