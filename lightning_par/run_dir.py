"""The run's version directory (``save_dir/name/version_N``): claimed atomically, held while the run lives, and the
interrupted saves that dead runs left in theirs removed.

Lightning picks ``version_N`` by listing the directories when the logger is first asked, and creates it only when
it first writes: two runs started at once on the same ``save_dir`` both take ``version_0`` and write into one
directory. Here global rank 0 creates the directory itself (``mkdir`` fails if it exists: the next number is taken,
with a warning) before anything is logged, and holds an advisory lock on ``version_N/.lightning-par.lock`` until
the process ends (the kernel drops it when the process dies, kill -9 included), which tells later runs that the
directory's saves are in progress, not interrupted.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO, Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par._compat import logger_version, set_logger_version
from lightning_par.plugins import checkpoint_files

LOCK = ".lightning-par.lock"
_held: list[IO[bytes]] = []  # the locks of this process's runs, kept open until it exits


def claim(logger: Any, root: Path) -> None:
    """Create and lock this run's version directory under ``root`` (``save_dir/name``), one rank. A version the user
    gave (or a restart continues) is kept; a number another run took a moment ago is skipped, with a warning."""
    version = logger_version(logger)
    chosen = version is not None
    version = logger.version if not chosen else version
    if isinstance(version, int) and not chosen:
        first = version
        root.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                (root / f"version_{version}").mkdir()
                break
            except FileExistsError:  # another run listed the same directories and created it first
                version += 1
        if version != first:
            set_logger_version(logger, version)
            rank_zero_warn(f"{root / f'version_{first}'} was taken by another run started at the same time: this "
                           f"run logs to {root / f'version_{version}'}.")
    directory = root / (version if isinstance(version, str) else f"version_{version}")
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / LOCK, "ab")  # noqa: SIM115 -- held open until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        rank_zero_warn(f"{directory} is in use by another run that is still running: both write there (give this "
                       "run another --trainer.logger.init_args.version, or wait for the other).")
        return
    _held.append(lock)


def in_use(directory: Path) -> bool:
    """Whether a live run holds ``directory`` (its lock is taken)."""
    try:
        with open(directory / LOCK, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except BlockingIOError:
        return True
    return False


def sweep_interrupted(root: Path) -> None:
    """Remove the interrupted saves (``*.partial``) that runs no longer alive left in their version directories
    under ``root``: they are never resumed from, and each can be as large as a checkpoint. A directory a live run
    holds is left alone, as is anything written since this process started."""
    for partial in sorted(root.glob("*/checkpoints/*.partial")):
        try:
            if in_use(partial.parent.parent) or _newest_change(partial) >= checkpoint_files.STARTED:
                continue
            size = _size(partial)
            checkpoint_files.remove(partial)
        except OSError:  # gone meanwhile, or not ours to remove: left as it is
            continue
        rank_zero_info(f"lightning-par: removed {partial}, a save interrupted in an earlier run ({size / 2**20:.1f} "
                       "MiB)")


def _newest_change(path: Path) -> float:
    times = [path.lstat().st_mtime]
    if path.is_dir():
        times += [p.lstat().st_mtime for p in path.rglob("*")]
    return max(times)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())
    return path.lstat().st_size
