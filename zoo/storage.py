"""Run paths that may be local or on object storage (``gs://``, ``s3://``): the one file-system layer.

A run path is an :class:`etils.epath.Path`: pathlib's interface, on the local
disk or, for ``gs://`` and ``s3://``, on fsspec's ``gcsfs`` and ``s3fs`` (the
``lmzoo[gcs]`` and ``lmzoo[s3]`` extras). Arrays do not go through it: Orbax and
TensorStore are given the URL and use their own drivers. Small files (configs,
logs, cards) do. :func:`run_path` turns what a user wrote into one, saying in one
line what to install for a scheme whose extra is missing;
:func:`check_writable` is the preflight's probe (an object written and removed);
:func:`fetched` brings a checkpoint folder on a bucket into a local cache, where
the checkpoint readers read it.

Object stores have no folders and no append: a "folder" exists once an object
lies under its prefix, and a log is rewritten whole (each write atomic).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.errors import UserError

if TYPE_CHECKING:
    from etils.epath import Path as RunPath
else:
    RunPath = object  # the type, for annotations; the class is imported when a path is made

# scheme -> (the fsspec package it needs, the extra that installs it)
SCHEMES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


def scheme_of(spec: str | os.PathLike[str]) -> str | None:
    """The URL scheme of ``spec`` (``gs``, ``s3``, or another one), or None for a local path."""
    text = os.fspath(spec)
    head, sep, _ = text.partition("://")
    return head.lower() if sep and head.replace("+", "").replace("-", "").isalnum() else None


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names object storage rather than the local disk."""
    return scheme_of(path) is not None


def run_path(spec: str | os.PathLike[str], what: str = "output_dir") -> RunPath:
    """``spec`` as a run path: local ones made absolute, ``gs://`` and ``s3://`` ones checked to have their
    extra installed. ``what`` names the setting in the one-line error of an unknown scheme or missing extra."""
    from etils import epath

    scheme = scheme_of(spec)
    if scheme is None:
        return epath.Path(os.fspath(spec)).expanduser().absolute()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise UserError(f"{what} {os.fspath(spec)}: unknown scheme {scheme}://; use a local path, {known}")
    package, extra = SCHEMES[scheme]
    if importlib.util.find_spec(package) is None:
        raise UserError(f"{what} {os.fspath(spec)}: {scheme}:// needs {package}; pip install 'lmzoo[{extra}]'")
    _no_listing_cache()
    if scheme == "s3":  # Orbax's arrays on s3:// need TensorStore's S3 driver taught to it
        from zoo.orbax_s3 import install

        install()
    return epath.Path(os.fspath(spec))


def _no_listing_cache() -> None:
    """fsspec remembers a bucket's listings; TensorStore writes checkpoints behind its back, so a remembered
    listing would hide a step Orbax just committed. Listings are asked for each time."""
    import fsspec.config

    for proto in ("gs", "gcs", "s3", "s3a"):
        fsspec.config.conf.setdefault(proto, {})["use_listings_cache"] = False


def local(path: RunPath) -> Path:
    """A local run path as a :class:`pathlib.Path` (for code that writes on the local disk only)."""
    assert not is_remote(path), path
    return Path(os.fspath(path))


def remove_tree(path: RunPath | Path) -> None:
    """Remove the folder ``path`` and what it holds, if it is there (a prefix and its objects, on a bucket)."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    from etils import epath

    remote = epath.Path(os.fspath(path))
    if remote.exists():
        remote.rmtree()


def empty_prefix(path: RunPath, keep: tuple[str, ...] = ()) -> None:
    """Remove every object under the prefix ``path`` (object storage) but those named in ``keep`` (relative names)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(os.fspath(path))
    root = root.rstrip("/")
    doomed = [k for k in fs.find(root) if k[len(root) + 1:] not in keep]
    if doomed:
        fs.rm(doomed)


def file_sizes(folder: RunPath | Path) -> dict[str, int]:
    """Each file under ``folder`` (a local folder, or the objects under a prefix): its name relative to ``folder``
    -> its size in bytes."""
    if not is_remote(folder):
        root = Path(os.fspath(folder))
        return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    import fsspec

    fs, key = fsspec.core.url_to_fs(os.fspath(folder))
    key = key.rstrip("/")
    return {k[len(key) + 1:]: int(info.get("size") or 0) for k, info in fs.find(key, detail=True).items()
            if info.get("type") != "directory"}


def move_tree(src: RunPath, dest: RunPath) -> None:
    """Move the folder ``src`` to ``dest``: renamed on the local disk; on object storage each object copied,
    then the old ones removed (a bucket has no folder to rename; s3fs's recursive move fails on a prefix)."""
    if not is_remote(src):
        src.rename(dest)
        return
    import fsspec

    fs, root = fsspec.core.url_to_fs(os.fspath(src))
    _, target = fsspec.core.url_to_fs(os.fspath(dest))
    root, target = root.rstrip("/"), target.rstrip("/")
    for key in fs.find(root):
        fs.copy(key, target + key[len(root):])
    fs.rm(root, recursive=True)


def upload_tree(src: Path, dest: RunPath | Path, last: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
    """Copy the local folder ``src`` into ``dest`` (files under their relative names; ``dest`` local or on a
    bucket); the files named ``last`` (relative names) are copied after every other, so a reader that waits for
    them sees a whole folder. Files whose name matches a pattern of ``skip`` (``*.bin``) are left out."""
    import fnmatch

    files = sorted(p for p in src.rglob("*")
                   if p.is_file() and not any(fnmatch.fnmatch(p.name, pat) for pat in skip))
    for f in sorted(files, key=lambda p: p.relative_to(src).as_posix() in last):
        target = dest / f.relative_to(src).as_posix()
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "rb") as r, target.open("wb") as w:
            shutil.copyfileobj(r, w)


def fetched(url: str | os.PathLike[str], marker: str, what: str, leave: tuple[str, ...] = ()) -> Path:
    """A local copy of the folder at ``url`` (object storage), in lmzoo's cache (``LMZOO_CACHE``, default
    ``~/.cache/lmzoo``), brought up to date: a file is downloaded again when its object changed (its listing
    entry: generation, ETag, size). ``marker`` is the file the folder must hold (``model.json``; written last
    by its writer, so a folder that has it is whole); without it, one line naming ``what``. The subfolders named
    ``leave`` are not copied (a checkpoint's ``params/``: Orbax reads its arrays at the URL); :func:`origin`
    gives the URL back for the copy."""
    remote = run_path(url, what)
    if not (remote / marker).exists():
        raise UserError(f"{what} {os.fspath(url)}: no checkpoint there (no {marker}; a training run's checkpoint "
                        f"is its final/ folder)")
    fs, root, dest = _remote(os.fspath(url))
    files = {rel: stamp for rel, stamp in _listing(fs, root).items() if rel.split("/", 1)[0] not in leave}
    _mirror(fs, root, dest, files, marker, prune=True)
    _replace_with(_origin_file(dest), lambda tmp: Path(tmp).write_text(os.fspath(url).rstrip("/")))
    return dest


def object_stamps(url: str) -> dict[str, str]:
    """Each object under ``url``: its name relative to ``url`` -> a stamp of its listing entry (generation, ETag,
    size, ...): another stamp, another object. What identifies files that are not copied (a checkpoint's arrays)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    return _listing(fs, root.rstrip("/"))


def origin(copy: str | os.PathLike[str]) -> str | None:
    """The URL of the folder that :func:`fetched` copied to the local folder ``copy``; None for any other folder."""
    f = _origin_file(Path(os.fspath(copy)).absolute())
    return f.read_text() if f.is_file() else None


def _origin_file(dest: Path) -> Path:
    # beside the copy, as its stamps are: the copy holds the folder's files only
    return dest.parent / f".{dest.name}.lmzoo-origin"


def _remote(url: str) -> tuple[Any, str, Path]:
    """(its fsspec file system, its key without a trailing slash, where its copy goes in lmzoo's cache)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    return fs, root, _cache_root() / (scheme_of(url) or "") / root


def _stamp(info: dict[str, Any]) -> str:
    """An object's listing entry (generation, ETag, size, ...) as one string: another one, another object."""
    from fsspec.utils import tokenize

    return str(tokenize(sorted((n, str(v)) for n, v in info.items())))


def _listing(fs: Any, root: str) -> dict[str, str]:
    """Each object under ``root``: its name relative to ``root`` -> its :func:`_stamp`."""
    return {k[len(root) + 1:]: _stamp(info) for k, info in fs.find(root, detail=True).items()
            if info.get("type") != "directory"}


def _replace_with(target: Path, write: Callable[[str], object]) -> None:
    """Write ``target`` through ``write`` (given a temporary name beside it), then rename it into place: processes
    that share a cache (several on one host) never read a half-downloaded file, nor a half-written record."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")
    try:
        write(str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _cache_root() -> Path:
    return Path(os.environ.get("LMZOO_CACHE", "~/.cache/lmzoo")).expanduser() / "objects"


def check_writable(path: RunPath, what: str = "output_dir") -> None:
    """Write a small probe object under ``path`` and remove it: a bucket that does not exist, missing or wrong
    credentials, or a prefix the credentials may not write is one line naming the URL and what to set, before
    anything else is written. A local path is left to the local checks."""
    if not is_remote(path):
        return
    url = os.fspath(path)
    probe = path / f".lmzoo-probe-{uuid.uuid4().hex}"
    try:
        probe.write_text("probe")
        probe.unlink()
    except Exception as e:  # fsspec's errors differ per store; the message says which it was
        raise UserError(f"{what} {url}: cannot write there ({_reason(e)}); {_fix(scheme_of(url) or '')}") from None


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _fix(scheme: str) -> str:
    if scheme == "gs":
        return ("check that the bucket exists and that the credentials (gcloud auth application-default login, "
                "or GOOGLE_APPLICATION_CREDENTIALS) may write to it")
    return ("check that the bucket exists and that the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE; AWS_ENDPOINT_URL for a store other than AWS) may write to it")


def _mirror(fs: Any, root: str, dest: Path, files: dict[str, str], marker: str | None, prune: bool) -> None:
    """Bring the local folder ``dest`` up to date with the objects under ``root`` (``files``: relative name ->
    a stamp of its listing entry): a file is downloaded when its stamp changed, ``marker`` last; ``prune``
    removes the files that left the bucket. Each file lands whole (:func:`_replace_with`). The
    stamps are kept beside ``dest``, not in it: a reader of the folder (a data folder's files) sees its files only."""
    import json

    stamps_file = dest.parent / f".{dest.name}.lmzoo-fetched.json"
    stamps = json.loads(stamps_file.read_text()) if stamps_file.is_file() else {}
    for rel in sorted(files, key=lambda r: r == marker):  # the marker last, as the writer wrote it
        target = dest / rel
        if stamps.get(rel) != files[rel] or not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _replace_with(target, functools.partial(fs.get_file, f"{root}/{rel}"))
            stamps[rel] = files[rel]
            _replace_with(stamps_file, lambda tmp: Path(tmp).write_text(json.dumps(stamps)))
    if prune:
        for rel in set(stamps) - set(files):  # gone from the bucket: gone from the copy
            (dest / rel).unlink(missing_ok=True)
            del stamps[rel]
    dest.mkdir(parents=True, exist_ok=True)
    _replace_with(stamps_file, lambda tmp: Path(tmp).write_text(json.dumps(stamps)))


def local_copy(spec: str | os.PathLike[str], what: str) -> Path:
    """The file or folder ``spec`` on the local disk: a local path as it is (``~`` expanded), a URL as a copy in
    lmzoo's cache (as :func:`fetched` keeps one, with no marker: an input a library reads from a local path,
    such as a data file or folder, or a tokenizer folder). A URL with nothing under it, or one that cannot be
    read (a missing bucket, missing credentials), is one line naming ``what``."""
    if not is_remote(spec):
        return Path(os.fspath(spec)).expanduser()
    url = os.fspath(spec)
    run_path(url, what)  # an unknown scheme, a missing extra: one line
    fs, root, dest = _remote(url)
    try:
        if fs.isfile(root):  # one object: its copy sits in its folder's copy, beside the others fetched there
            _mirror(fs, root.rsplit("/", 1)[0], dest.parent, {dest.name: _stamp(fs.info(root))}, None, prune=False)
            return dest
        files = _listing(fs, root)
    except Exception as e:  # fsspec's errors differ per store; the message says which it was
        raise UserError(f"{what} {url}: cannot read it ({_reason(e)}); {_fix(scheme_of(url) or '')}") from None
    if not files:
        raise UserError(f"{what} {url}: no such file or folder (no object at or under it)")
    _mirror(fs, root, dest, files, None, prune=True)
    return dest
