"""What a tensor-parallel group leaves on its host's disk while it runs, and how it goes away.

A group owns two things: the private directory of its FileStore (engine/parallel/group.py) and, on CPU, the shared
memory file of its all-reduces (engine/parallel/host_reduce.py). Both are named `tandem-tp-<pid>-...` after the
process of its rank 0, which removes them when the group closes or fails to start. A rank 0 killed outright (a
SIGKILL, the host's OOM killer) cannot: its followers remove them when they see it gone, and a group created
later on the host removes those of every rank 0 no longer running (remove_stale_group_files), so a killed
process never leaves a file behind for good.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine.parallel.host_reduce import shared_memory_dir

if TYPE_CHECKING:
    from engine.parallel.group import Rendezvous

logger = logging.getLogger(__name__)

GROUP_FILE = re.compile(r"tandem-tp-(\d+)-")


def group_file_prefix(pid: int | None = None) -> str:
    """The start of the name of every file of a group whose rank 0 is process `pid` (default: this process)."""
    return f"tandem-tp-{os.getpid() if pid is None else pid}-"


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def private_store_path() -> str:
    """A new FileStore path in a directory only this user can open (mkdtemp: mode 0700); the caller removes
    the directory (remove_store) when the group is gone."""
    return str(Path(tempfile.mkdtemp(prefix=group_file_prefix())) / "store")


def remove_store(store_path: str) -> None:
    shutil.rmtree(Path(store_path).parent, ignore_errors=True)


def remove_group_files(rendezvous: Rendezvous) -> None:
    """Everything the group left on disk: the shared memory file (if any) and the store's private directory.
    Idempotent; any rank may call it."""
    if rendezvous.shm_path:
        Path(rendezvous.shm_path).unlink(missing_ok=True)
    remove_store(rendezvous.store_path)


def group_files_of(pid: int) -> list[Path]:
    """The files and store directories on this host of the groups whose rank 0 is (or was) process `pid`."""
    return [path for directory in _group_dirs() for path in directory.glob(group_file_prefix(pid) + "*")]


def remove_stale_group_files() -> list[Path]:
    """Remove this user's group files and store directories whose rank 0 process no longer runs; returns them."""
    removed = []
    for path in (path for directory in _group_dirs() for path in directory.glob("tandem-tp-*")):
        match = GROUP_FILE.match(path.name)
        if match is None or process_alive(int(match.group(1))) or not _owned(path):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        logger.warning("removed %d files of tensor-parallel groups whose rank 0 was killed: %s", len(removed),
                       ", ".join(p.name for p in removed))
    return removed


def _group_dirs() -> set[Path]:
    return {shared_memory_dir(), Path(tempfile.gettempdir())}


def _owned(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False
