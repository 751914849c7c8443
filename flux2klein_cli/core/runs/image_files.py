"""PNG files: the one encoder (pixels and their parameters as text chunks), atomic writes, and reading
the parameters back.

Writes are atomic: a hidden temporary file in the target directory (core/temporaries.py), fsync, then a
rename, so a crash, an interrupt or a full disk never leaves a half-written PNG under the final name.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, PngImagePlugin, UnidentifiedImageError

from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.limits import LIMITS
from flux2klein_cli.core.runs.outputs import check_png_name, refuse_existing
from flux2klein_cli.core.temporaries import temporary_file

# zlib level 3: on photo-like 512x512 images 1.6-3.6x faster to encode than PIL's default (6), for
# files 10-13% larger (docs/benchmarks.md); the encoding is on every image's path (batch, serve).
PNG_COMPRESS_LEVEL = 3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Each key is one text chunk of its own, for exiftool, `identify -verbose` and image viewers: a string as
# it is, anything else as JSON. One more iTXt chunk under this key says which chunks hold JSON, so reading
# them back gives the original types, and every value is stored once. A string PNG text cannot hold (a
# NUL, which the format forbids in text, or another control character but newline and tab) is stored
# as JSON too, escaped: read back, it is the original string.
JSON_KEY = "flux2klein"
METADATA_FORMAT = 2  # 1 (older files): the JSON_KEY chunk held the whole metadata dict

MetadataValue = str | int | float | bool | None | Sequence[Any] | Mapping[str, Any]


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):  # numpy arrays
        return value.tolist()
    return str(value)  # paths and the like


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=_json_default)


def _check_key(key: str) -> None:
    # PNG keywords: 1-79 Latin-1 characters, no leading/trailing/double spaces.
    ok = isinstance(key, str) and 0 < len(key) < 80 and key == key.strip() and "  " not in key
    try:
        key.encode("latin-1")
    except (AttributeError, UnicodeEncodeError):
        ok = False
    if not ok or key == JSON_KEY:
        raise ValueError(f"invalid PNG metadata key {key!r}")


def _plain(value: str) -> bool:
    return not any(ord(c) < 32 and c not in "\n\t" for c in value)


def _pnginfo(metadata: Mapping[str, Any]) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    as_json, total = [], 0
    for key, value in metadata.items():
        _check_key(key)
        plain = isinstance(value, str) and _plain(value)
        text = value if plain else _to_json(value)
        if not plain:
            as_json.append(key)
        total += len(key) + len(text.encode("utf-8", "surrogatepass"))
        if total > LIMITS.metadata_bytes:
            raise UserInputError(f"the PNG metadata would take more than {LIMITS.metadata_bytes} bytes "
                                 f"(at field {key}); shorten it")
        # Pillow writes tEXt (Latin-1), or iTXt (UTF-8) when the text needs it.
        info.add_text(key, text)
    info.add_itxt(JSON_KEY, _to_json({"format": METADATA_FORMAT, "json": as_json}))
    return info


def _commit(tmp: Path, path: Path, force: bool) -> None:
    if force:
        os.replace(tmp, path)
        return
    try:
        # A hard link fails if the name exists: no window in which another writer could be clobbered.
        os.link(tmp, path)
    except FileExistsError:
        refuse_existing([path])
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
        refuse_existing([path])  # a filesystem without hard links: check, then rename
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    # Make the rename itself durable; not every platform can open a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def png_bytes(image: np.ndarray, metadata: Mapping[str, MetadataValue] | None = None) -> bytes:
    """The one PNG encoder: an (H, W, 3) uint8 image, with `metadata` as text chunks (write_png) or
    none (serve's b64_json)."""
    pixels = np.asarray(image)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {pixels.shape} {pixels.dtype}")
    info = None if metadata is None else _pnginfo(metadata)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG", pnginfo=info, compress_level=PNG_COMPRESS_LEVEL)
    return out.getvalue()


def write_png(
    path: str | os.PathLike[str], image: np.ndarray, metadata: Mapping[str, MetadataValue], *, force: bool
) -> Path:
    """Write an (H, W, 3) uint8 image as a PNG with `metadata` as text chunks, atomically.

    Without `force` an existing file is an error and is left untouched. Returns the path written.
    """
    path = Path(path).expanduser()
    check_png_name(path)
    if path.is_dir():
        raise FieldError("output", f"{path} is a directory")
    if not force:
        refuse_existing([path])
    data = png_bytes(image, metadata)  # bad keys fail before any file exists

    try:
        with temporary_file(path.parent, path.name) as (fd, tmp):
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _commit(tmp, path, force)
    except FileNotFoundError as e:
        if not path.parent.exists():
            raise UserInputError(f"output directory {path.parent} does not exist") from None
        raise Flux2KleinError(f"could not write {path}: {e.strerror or e}") from e
    except PermissionError:
        raise UserInputError(f"cannot write to output directory {path.parent}: permission denied") from None
    except NotADirectoryError:
        raise UserInputError(f"{path.parent} is not a directory") from None
    except OSError as e:  # disk full, I/O error: a runtime failure (exit 1)
        raise Flux2KleinError(f"could not write {path}: {e.strerror or e}") from e
    _fsync_dir(path.parent)
    return path


def _png_text(p: Path) -> dict[str, str]:
    try:
        with Image.open(p) as im:
            if im.format != "PNG":
                raise UserInputError(f"{p} is not a PNG file")
            return {k: str(v) for k, v in getattr(im, "text", {}).items()}  # iTXt values are str subclasses
    except FileNotFoundError:
        raise UserInputError(f"{p} does not exist") from None
    except IsADirectoryError:
        raise UserInputError(f"{p} is a directory, not a PNG file") from None
    except UnidentifiedImageError:
        raise UserInputError(f"{p} is not a PNG file") from None
    except OSError as e:
        raise UserInputError(f"cannot read {p}: {e}") from None


def _decode(text: dict[str, str]) -> tuple[int | None, dict[str, Any] | None]:
    """The metadata format the JSON_KEY chunk declares (None: no such chunk; 1: the older whole-dict form;
    0: unreadable) and the metadata it gives (None unless the format is one this version reads)."""
    if JSON_KEY not in text:
        return None, None
    try:
        decoded = json.loads(text[JSON_KEY])
    except ValueError:
        return 0, None
    if not isinstance(decoded, dict):
        return 0, None
    if "format" not in decoded:
        return 1, decoded  # format 1: the whole dict
    version = decoded["format"]
    if not isinstance(version, int) or isinstance(version, bool):
        return 0, None
    if version != METADATA_FORMAT:
        return version, None
    listed = decoded.get("json", ())
    try:
        return version, {k: json.loads(v) if k in listed else v for k, v in text.items() if k != JSON_KEY}
    except ValueError:
        return 0, None


def read_run_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parameters a PNG written by flux2klein carries (`generate --from`, `inspect IMAGE.png`); a PNG
    without them, or written in a metadata format newer than this version reads, is a UserInputError."""
    p = Path(path)
    version, metadata = _decode(_png_text(p))
    if version is None:
        raise UserInputError(f"{p} carries no flux2klein parameters (it was not written by generate, edit or batch)")
    if version > METADATA_FORMAT:
        raise UserInputError(f"{p} carries parameters in metadata format {version}, newer than this flux2klein "
                             f"reads ({METADATA_FORMAT}); upgrade flux2klein")
    if metadata is None:
        raise UserInputError(f"{p}: its flux2klein parameters cannot be read (a damaged or altered chunk)")
    return metadata


def is_png_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an existing file that starts with the PNG signature."""
    try:
        with open(path, "rb") as f:
            return f.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE
    except OSError:
        return False
