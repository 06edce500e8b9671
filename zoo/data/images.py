"""Images of data rows: a row's image reference -> an RGB PIL image.

A reference is what TRL's vision datasets hold in their ``images`` (or ``image``) column:

* a path, relative to the data file's folder (or absolute);
* ``{"bytes": ..., "path": ...}``, HF datasets' ``Image`` feature as stored in parquet/Arrow (the bytes win;
  without them the path is read);
* raw encoded bytes (PNG, JPEG, ...);
* a PIL image (rows made in Python).

Pillow is a run-time dependency through matplotlib (it is not named in pyproject.toml itself).
A problem with one image raises :class:`BadImage` naming the image (``images[0] 'cat.png' ...``); the chat floor
turns it into its row error, which adds the row's file and line (:func:`zoo.data.row_origin.bad_row`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any


class BadImage(ValueError):
    """One image of a row cannot be used; the message names it and says why (the caller names the row)."""


def open_image(ref: Any, base_dir: str | Path, where: str) -> Any:
    """The RGB PIL image of ``ref`` (see the module docstring); ``where`` names it in the row (``images[0]``).

    Raises BadImage when the file is missing, the bytes are not an image Pillow reads, or ``ref`` is of no
    known kind.
    """
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict) and ("bytes" in ref or "path" in ref):
        data, path = ref.get("bytes"), ref.get("path")
        if data is not None:
            return _decode(data, f"{where} (bytes of {path!r})" if path else where)
        if path is not None:
            return _read(path, base_dir, where)
        raise BadImage(f"{where} has neither bytes nor a path; give the image as a path or its bytes")
    if isinstance(ref, bytes | bytearray | memoryview):
        return _decode(bytes(ref), where)
    if isinstance(ref, str | Path):
        return _read(ref, base_dir, where)
    raise BadImage(f"{where} is a {type(ref).__name__}, not an image; give a path, bytes, or "
                 "{'bytes': ..., 'path': ...} (HF datasets' Image feature)")


def _read(path: str | Path, base_dir: str | Path, where: str) -> Any:
    """The image at ``path`` (relative paths are under ``base_dir``)."""
    if not str(path).strip():
        raise BadImage(f"{where} is an empty path; give the image file's path, relative to the data file")
    full = Path(base_dir) / Path(path).expanduser()
    if not full.is_file():
        raise BadImage(f"{where} {str(path)!r} not found (looked for {full}); "
                     "image paths are relative to the data file's folder")
    try:
        data = full.read_bytes()
    except OSError as e:
        raise BadImage(f"{where} {str(path)!r} cannot be read ({e.strerror or e})") from None
    return _decode(data, f"{where} {str(path)!r}")


def _decode(data: bytes, what: str) -> Any:
    """The RGB image encoded in ``data``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")  # decodes now: a truncated file fails here, not in the image processor
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadImage(f"{what} is not an image Pillow can read ({type(e).__name__}: {e}); "
                     "give a PNG, JPEG, WebP or other Pillow-readable image") from None
