"""Checks of a ``.pt2`` archive from outside, made before anything in it is deserialised or run.

A ``.pt2`` file is a zip. ``torch.export.load`` unpickles some of its members with
``weights_only=False`` (tensors marked ``use_pickle``, custom and opaque constants, and sample
inputs that the restricted unpickler refuses), so a crafted file runs code while it loads;
``torch._inductor.aoti_load_package`` extracts members to disk by their names and loads the shared
library inside. ``check_program_archive`` and ``check_package_archive`` refuse, naming the member
and the reason, whatever the loaders would run or write outside their folder:

* member names that are absolute, climb out (``..``), use backslashes or NUL, repeat, or are
  symbolic links;
* members larger than a bound (``max_member_bytes``; JSON and pickles are read whole by the
  loaders), declared or actual: a small compressed file cannot make the loader allocate gigabytes;
* in an exported program: pickled tensors, custom-class and opaque-object constants, and sample
  inputs that ``torch.load(weights_only=True)`` cannot read (the loader would retry them with the
  unrestricted unpickler).

What is not checked, and so must be trusted: an AOTInductor package is native code, whose shared
library runs when the package loads; the values of an exported program's weights and the graph's
operators (an exported program runs only ATen and registered ops, but it runs them on the inputs
you give).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import posixpath
import stat
import zipfile
from typing import BinaryIO

import torch

# Members that the loaders read whole into memory (JSON, pickles) may be at most this large.
MAX_MEMBER_BYTES = 1 << 30


class UnsafeArchiveError(ValueError):
    """A ``.pt2`` archive that the loader would not load safely; the message names the member."""


def _refuse(path: str, member: str, why: str) -> None:
    raise UnsafeArchiveError(f"{path}: member {member!r} {why}; refusing to load it")


def _check_names(path: str, archive: zipfile.ZipFile) -> None:
    seen: set[str] = set()
    for info in archive.infolist():
        name = info.filename
        if "\x00" in name or "\\" in name:
            _refuse(path, name, "has a NUL or backslash in its name")
        if name.startswith("/") or posixpath.isabs(name) or (len(name) > 1 and name[1] == ":"):
            _refuse(path, name, "has an absolute name")
        if ".." in name.split("/"):
            _refuse(path, name, "climbs out of the archive's folder ('..')")
        if stat.S_ISLNK(info.external_attr >> 16):
            _refuse(path, name, "is a symbolic link")
        if name in seen:
            _refuse(path, name, "appears twice")
        seen.add(name)


def _read_bounded(path: str, archive: zipfile.ZipFile, name: str, limit: int) -> bytes:
    """The member's bytes, refusing it past ``limit`` (declared or actual: the header may lie)."""
    info = archive.getinfo(name)
    if info.file_size > limit:
        _refuse(path, name, f"is {info.file_size} bytes, past the {limit}-byte bound")
    with archive.open(info) as member:
        data = member.read(limit + 1)
    if len(data) > limit:
        _refuse(path, name, f"holds more than the {limit}-byte bound")
    return data


def _check_restricted_pickle(path: str, name: str, data: bytes) -> None:
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        _refuse(
            path,
            name,
            "needs the unrestricted unpickler (torch.load(weights_only=True) refuses it: "
            f"{first_line})",
        )


def _check_payload_config(path: str, archive: zipfile.ZipFile, name: str, limit: int) -> None:
    try:
        config = json.loads(_read_bounded(path, archive, name, limit))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        _refuse(path, name, f"is not valid JSON ({error})")
    entries = config.get("config", {}) if isinstance(config, dict) else {}
    if not isinstance(entries, dict):
        _refuse(path, name, "has no 'config' mapping")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            _refuse(path, name, f"describes {fqn!r} without a mapping")
        if meta.get("use_pickle"):
            _refuse(path, name, f"marks {fqn!r} ({meta.get('path_name')}) for unpickling")
        stored = str(meta.get("path_name", ""))
        if stored.startswith(("custom_obj", "opaque_obj")):
            _refuse(path, name, f"holds {fqn!r} as a pickled object ({stored})")


def check_program_archive(
    file: BinaryIO, path: str, max_member_bytes: int = MAX_MEMBER_BYTES
) -> zipfile.ZipFile:
    """Check an exported program's archive (``torch.export.save``'s format) read from ``file``;
    returns the open ``ZipFile``. Raises ``UnsafeArchiveError`` naming the first unsafe member."""
    try:
        archive = zipfile.ZipFile(file)
    except zipfile.BadZipFile as error:
        raise UnsafeArchiveError(f"{path}: not a .pt2 archive (a zip): {error}") from None
    _check_names(path, archive)
    for info in archive.infolist():
        name = info.filename
        if name.endswith(".json"):
            _read_bounded(path, archive, name, max_member_bytes)
        if name.endswith(("weights_config.json", "constants_config.json")):
            _check_payload_config(path, archive, name, max_member_bytes)
        elif "/data/sample_inputs/" in f"/{name}" or name.startswith("data/sample_inputs/"):
            data = _read_bounded(path, archive, name, max_member_bytes)
            _check_restricted_pickle(path, name, data)
    return archive


def check_package_archive(path: str | os.PathLike) -> None:
    """Check an AOTInductor package before it is extracted: no member may land outside the
    extraction folder. The package's shared library is still native code that runs on load."""
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as archive:
            _check_names(path, archive)
    except zipfile.BadZipFile as error:
        raise UnsafeArchiveError(f"{path}: not a .pt2 package (a zip): {error}") from None


__all__ = [
    "MAX_MEMBER_BYTES",
    "UnsafeArchiveError",
    "check_package_archive",
    "check_program_archive",
]
