"""The TCP ports a process listens on, read from /proc (Linux): its sockets (/proc/<pid>/fd) matched against the
kernel's table of listening sockets (/proc/net/tcp, tcp6: state 0A). No dependency beyond the standard library."""
from __future__ import annotations

import os

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening_ports(pid: int | None = None) -> set[tuple[str, int]]:
    """(hex local address, port) of every TCP socket process pid (default: this one) listens on."""
    inodes = _socket_inodes(os.getpid() if pid is None else pid)
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)  # the header
            for row in rows:
                fields = row.split()
                address, port = fields[1].rsplit(":", 1)
                if fields[3] == _LISTEN and fields[9] in inodes:
                    ports.add((address, int(port, 16)))
    return ports
