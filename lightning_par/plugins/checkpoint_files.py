"""A checkpoint directory that becomes visible only when complete, and is checked whole before it loads.

Saving writes ``NAME.partial``. Once every file in it is written and synced, ``manifest.json`` -- every file's size
and CRC-32 -- is written last, then the directory takes the name ``NAME``: an existing ``NAME`` is moved aside to
``NAME``'s stem + ``.old`` + its suffix first and deleted only after the rename is durable. Loading reads the manifest
before anything else: a directory without one was not written to the end, and a file whose size or checksum differs
is named in the error.

Hand-written because DCP lacks it: DCP fsyncs its files but writes them in place, with no completion marker and no
checksums, and POSIX cannot rename a directory over a non-empty one (hence the move aside). The moved-aside name
keeps Lightning's ``.ckpt`` suffix so that ``ckpt_path="last"`` still finds the previous checkpoint if a crash falls
between the two renames; :func:`resolve` and :func:`prepare` undo that state.

A one-file checkpoint takes the same path (:func:`commit_file`), its size and CRC-32 in a sidecar, ``NAME.crc32.json``
(the file itself stays Lightning's, which any tool loads); :func:`verify_file` checks it before a load. Every name read
from a manifest is confined to its directory (:func:`confined`), as are DCP's storage paths (sharded_checkpoint).

:func:`newest_complete` picks the checkpoint to resume from (the CLI's ``--ckpt_path=last`` and automatic restart):
the newest one that is complete by these marks, never an interrupted save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

MANIFEST = "manifest.json"
SIDECAR = ".crc32.json"  # a one-file checkpoint's checksum: NAME + SIDECAR
FORMAT = "lightning-par-checkpoint/1"
_CHUNK = 16 << 20  # bytes read at a time for checksums
STARTED = time.time()  # partial checkpoints older than this process were left by a crash
_UNCHECKED: set[Path] = set()  # one-file checkpoints without a checksum, warned about once each


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, truncated or corrupted, or holds what loading refuses to unpickle."""


def refused(err: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words (its own message runs to a page)."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    return f"it refers to {found.group(1)}" if found else str(err).splitlines()[0]


def partial_path(path: Path) -> Path:
    """Where ``path`` is written until it is complete; Lightning never takes it for a checkpoint (suffix)."""
    return path.with_name(path.name + ".partial")


def aside_path(path: Path) -> Path:
    """Where an existing ``path`` waits while a new one takes its name: ``last.ckpt`` -> ``last.old.ckpt``."""
    return path.with_name(f"{path.stem}.old{path.suffix}")


def exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def remove(path: Path) -> None:
    """Delete a checkpoint: a directory, a file (and its checksum), or a link (not what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        sidecar.unlink()


def link(target: Path, link_path: Path) -> None:
    """Point ``link_path`` (``last.ckpt`` under ``ModelCheckpoint(save_last="link")``) at ``target``, atomically: the
    new link is made beside and renamed over the old, so a crash leaves one or the other, never neither (Lightning
    deletes the old link first)."""
    if link_path.is_dir() and not link_path.is_symlink():  # a full copy an earlier ``save_last=True`` left
        shutil.rmtree(link_path)
    fresh = link_path.with_name(link_path.name + ".link.partial")
    remove(fresh)
    os.symlink(os.path.relpath(target, link_path.parent), fresh)
    os.replace(fresh, link_path)
    _fsync_dir(link_path.parent)


def resolve(path: Path) -> Path:
    """``path``, or its moved-aside predecessor when a crash between the two renames of :func:`commit` left only it."""
    aside = aside_path(path)
    return aside if not exists(path) and exists(aside) else path


def prepare(path: Path) -> None:
    """Before a save (one rank): put back a checkpoint a crash left moved aside, and clear interrupted saves: this
    name's, and any other a crashed earlier run left beside it (older than this process, so never a save of this
    run still being written in the background)."""
    aside = aside_path(path)
    if not exists(path) and exists(aside):
        os.replace(aside, path)
    remove(partial_path(path))
    if path.parent.is_dir():
        for stale in path.parent.glob("*.partial"):
            if stale.lstat().st_mtime < STARTED:
                remove(stale)


def save_failed(path: Path, error: BaseException, clean: bool = True) -> CheckpointError:
    """The one-line error of a save of ``path`` that failed (a full disk, most often), naming the checkpoint, the
    first failure and the space left; ``clean``: remove the interrupted save first (the rank that wrote it).

    DCP's own error holds every rank's traceback (hundreds of lines) and torch.save's names only its zip writer
    (``inline_container.cc: unexpected pos``); neither says which checkpoint."""
    if clean:
        try:
            remove(partial_path(path))  # frees the space it took; the previous checkpoint was never touched
        except OSError:
            pass
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if failures:
        rank, (error, _) = min(failures.items(), key=lambda item: item[0])
        where = f" on rank {rank}"
    else:
        where = ""
    reason = (str(error).strip().splitlines() or [""])[0][:300]
    try:
        free = f"; {shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free on its disk"
    except OSError:
        free = ""
    return CheckpointError(f"saving the checkpoint {path} failed{where} ({type(error).__name__}: {reason}){free}. "
                           "The previous checkpoint is still the latest; free space there, or save elsewhere "
                           "(--trainer.default_root_dir, ModelCheckpoint(dirpath=...)).")


def write_synced(file: Path, data: bytes) -> None:
    with open(file, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make the directory's entries (names created or renamed in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def confined(root: Path, name: str) -> Path:
    """``root / name`` for a ``name`` read from a checkpoint (a manifest entry, a DCP storage path), refused unless it
    stays inside ``root``: no absolute path, no ``..``, no symlink leading out. A crafted checkpoint could otherwise
    make a load read (or a check stat) any file of the machine."""
    pure = Path(name)
    if not name or pure.is_absolute() or ".." in pure.parts:
        raise CheckpointError(f"{root}: the checkpoint names the file {name!r}, outside its directory: refused.")
    file = root / pure
    if not file.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"{root}: {name!r} is a link to {file.resolve()}, outside the checkpoint: refused.")
    return file


def checksum(file: Path) -> int:
    crc = 0
    buffer = bytearray(_CHUNK)  # one buffer read into again and again: _CHUNK bytes held, not two chunks at a time
    view = memoryview(buffer)
    with open(file, "rb") as stream:
        while n := stream.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def describe(root: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files ``names`` in ``root``, as the manifest lists them."""
    return {name: {"bytes": (root / name).stat().st_size, "crc32": checksum(root / name)} for name in names}


def write_manifest(root: Path, files: dict[str, dict[str, int]]) -> None:
    """Write the manifest of ``root`` -- the last file of a checkpoint: its presence says the rest is complete."""
    body = {"format": FORMAT, "files": dict(sorted(files.items()))}
    write_synced(root / MANIFEST, json.dumps(body, indent=1).encode())


def commit(partial: Path, path: Path) -> None:
    """Give the complete directory ``partial`` the name ``path`` (one rank, after the manifest is written)."""
    _fsync_dir(partial)
    aside = aside_path(path)
    remove(aside)
    if exists(path):
        os.replace(path, aside)
    os.replace(partial, path)
    _fsync_dir(path.parent)  # both renames are durable before the previous checkpoint goes
    remove(aside)


def read_manifest(path: Path) -> dict[str, Any]:
    """The files a complete checkpoint directory holds, ``{name: {"bytes", "crc32"}}``, or a :class:`CheckpointError`
    that says why ``path`` is not one."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: it does not exist.")
    file = path / MANIFEST
    if not file.is_file():
        hint = (" It holds meta.pt: it was written by an earlier lightning-par, whose metadata is pickled."
                if (path / "meta.pt").is_file() else
                " It was not written to the end (a save interrupted?): resume from an earlier checkpoint.")
        raise CheckpointError(f"{path} is not a complete lightning-par checkpoint: {file.name} is missing.{hint}")
    try:
        body = json.loads(file.read_text())
        files = body["files"]
        if body["format"] != FORMAT:
            raise CheckpointError(f"{file} has format {body['format']!r}; this lightning-par reads {FORMAT!r}.")
        entries = {name: _entry(e) for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{file} is corrupted ({type(err).__name__}: {err}).") from err
    for name in entries:
        confined(path, name)
    return entries


def _entry(entry: dict[str, Any]) -> dict[str, int]:
    return {"bytes": int(entry["bytes"]), "crc32": int(entry["crc32"])}


def check_sizes(path: Path, files: dict[str, Any]) -> None:
    """Every listed file is there with its size (cheap: a ``stat`` each)."""
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete.")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file} is truncated or corrupted: {size} bytes, {entry['bytes']} when it was "
                                  "saved. Resume from an earlier checkpoint.")


def check_checksums(path: Path, files: dict[str, Any], names: list[str]) -> None:
    """The files ``names`` (a share of the manifest's) have the CRC-32 they were saved with."""
    for name in names:
        if checksum(path / name) != files[name]["crc32"]:
            raise _corrupted(path / name)


def _corrupted(file: Path) -> CheckpointError:
    return CheckpointError(f"{file} is corrupted: its CRC-32 differs from the one saved with it. Resume from an "
                           "earlier checkpoint.")


# -- one-file checkpoints: the checksum in a sidecar ----------------------------------------------------------------
def sidecar_path(path: Path) -> Path:
    """Where the checksum of one-file checkpoint ``path`` is kept: ``last.ckpt`` -> ``last.ckpt.crc32.json``."""
    return path.with_name(path.name + SIDECAR)


def _read_sidecar(sidecar: Path) -> list[dict[str, int]]:
    try:
        body = json.loads(sidecar.read_text())
        if body["format"] != FORMAT:
            raise CheckpointError(f"{sidecar} has format {body['format']!r}; this lightning-par reads {FORMAT!r}.")
        return [_entry(e) for e in body["accepted"]]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{sidecar} is corrupted ({type(err).__name__}: {err}).") from err


def _write_sidecar(sidecar: Path, accepted: list[dict[str, int]]) -> None:
    fresh = partial_path(sidecar)
    write_synced(fresh, json.dumps({"format": FORMAT, "accepted": accepted}).encode())
    os.replace(fresh, sidecar)
    _fsync_dir(sidecar.parent)


def commit_file(partial: Path, path: Path) -> None:
    """:func:`commit` for a one-file checkpoint (one rank, ``partial`` written and synced), with its checksum.

    The sidecar cannot be renamed together with the file, so while the renames are under way it accepts both the
    previous file and the new one: a crash at any point leaves a checkpoint (``path`` or its moved-aside
    predecessor) that it vouches for. Then it keeps the new one alone."""
    new = describe(partial.parent, [partial.name])[partial.name]
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        previous = _read_sidecar(sidecar)
    elif path.is_file() and not path.is_symlink():  # written without a checksum: vouched for as it is
        previous = list(describe(path.parent, [path.name]).values())
    else:
        previous = []  # none, or a link (checked through its target's sidecar)
    _write_sidecar(sidecar, [new, *previous])
    commit(partial, path)
    _write_sidecar(sidecar, [new])


def verify_file(path: Path, file: Path) -> None:
    """Check one-file checkpoint ``file`` -- ``path``, or what :func:`resolve` found in its place -- against the
    checksum saved beside ``path`` (beside its target for a link). A file without one (Lightning's own, another
    tool's) loads unchecked, with a warning the first time."""
    named = Path(os.path.realpath(path)) if path.is_symlink() else path
    sidecar = sidecar_path(named)
    if not sidecar.is_file():
        if named not in _UNCHECKED:
            _UNCHECKED.add(named)
            rank_zero_warn(f"{file} has no checksum ({sidecar.name}): it was not written by lightning-par, and loads "
                           "unchecked (damage to its tensors would go unnoticed).")
        return
    accepted = _read_sidecar(sidecar)
    size = file.stat().st_size
    if all(size != e["bytes"] for e in accepted):
        raise CheckpointError(f"{file} is truncated or corrupted: {size} bytes, "
                              f"{' or '.join(str(e['bytes']) for e in accepted)} when it was saved. Resume from an "
                              "earlier checkpoint.")
    if {"bytes": size, "crc32": checksum(file)} not in accepted:
        raise _corrupted(file)


# -- finding the newest complete checkpoint (``ckpt_path="last"``, automatic restart) --------------------------------
def is_complete(path: Path) -> bool:
    """Whether ``path`` (a link is followed) is a checkpoint written to the end, judged cheaply (no checksums): a
    directory with its manifest and every listed file at its size; a file at a size its checksum sidecar accepts,
    or, without one (Lightning's own writer), a whole zip archive (``torch.save``'s format: a truncated one lacks
    the directory at its end)."""
    target = Path(os.path.realpath(path))
    try:
        if target.is_dir():
            check_sizes(target, read_manifest(target))
            return True
        if not target.is_file():
            return False  # a dangling link
        sidecar = sidecar_path(target)
        if sidecar.is_file():
            return any(target.stat().st_size == e["bytes"] for e in _read_sidecar(sidecar))
        return zipfile.is_zipfile(target)
    except (CheckpointError, OSError):
        return False


def _saved_at(target: Path) -> float:
    """When ``target`` was completed: its manifest's time for a directory (written last), else the file's."""
    return (target / MANIFEST).stat().st_mtime if target.is_dir() else target.stat().st_mtime


def newest_complete(directories: list[Path]) -> Path | None:
    """The complete checkpoint (``*.ckpt``, a link resolved to what it names) saved last in any of ``directories``;
    ``None`` if there is none. Interrupted saves (``*.partial``) and dangling links are never taken."""
    found: dict[Path, float] = {}
    for directory in directories:
        if not directory.is_dir():
            continue
        for entry in directory.glob("*.ckpt"):
            target = Path(os.path.realpath(entry))
            if target not in found and is_complete(target):
                found[target] = _saved_at(target)
    return max(found, key=lambda target: (found[target], target.name)) if found else None
