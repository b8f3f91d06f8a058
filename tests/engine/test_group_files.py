"""The files a tensor-parallel group leaves on disk go away even when its rank 0 is killed: a later group removes
those of every rank 0 no longer running, and nothing of a running one."""
from __future__ import annotations

import os
import subprocess
import sys

from engine import LLM
from engine.parallel.group_files import group_file_prefix, group_files_of, process_alive, remove_stale_group_files
from engine.parallel.host_reduce import shared_memory_dir


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid)
    return child.pid


def _leave_files(pid: int, tmp_dir) -> list:
    """What a rank 0 killed before it cleaned up leaves: its shared memory file and its store directory."""
    shm = shared_memory_dir() / f"{group_file_prefix(pid)}deadbeef0000"
    shm.write_bytes(b"\0" * 64)
    store = tmp_dir / f"{group_file_prefix(pid)}abc123"
    store.mkdir()
    (store / "store").write_bytes(b"x")
    return [shm, store]


def test_files_of_a_dead_rank_0_are_removed_and_a_running_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    dead, alive = _dead_pid(), os.getpid()
    stale, kept = _leave_files(dead, tmp_path), _leave_files(alive, tmp_path)
    try:
        removed = remove_stale_group_files()
        assert set(stale) <= set(removed) and not [path for path in stale if path.exists()]
        assert all(path.exists() for path in kept) and not set(kept) & set(removed)
        assert sorted(group_files_of(alive)) == sorted(kept) and not group_files_of(dead)
    finally:
        kept[0].unlink(missing_ok=True)


def test_a_new_group_removes_a_killed_groups_files_and_leaves_none_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    dead = _dead_pid()
    stale = _leave_files(dead, tmp_path)
    with LLM("tiny", device="cpu", tensor_parallel_size=2) as llm:
        assert not [path for path in stale if path.exists()]
        assert llm.engine.tp_leader.rendezvous.store_path.startswith(str(tmp_path / group_file_prefix()))
    assert not group_files_of(os.getpid())
