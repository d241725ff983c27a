"""What a test's own processes left in /dev/shm, told apart from what its neighbours hold
there now: a serial test runs alone, but the other test process of `make test` may still
have work going on behind it (the worker processes of a loader an earlier test left open,
prefetching into shared memory), and its segments are mapped by its processes, where a
leak of this test's is mapped by no process (those that made it have exited) or by this
process's own tree."""

from __future__ import annotations

import os

import psutil


def mapped_outside(names: set[str], directory: str = "/dev/shm") -> set[str]:
    """Those of `names` (files in `directory`) that a live process outside this process and
    its descendants has mapped. Matched by inode: a POSIX semaphore is mapped under the
    temporary name glibc made it with (`sem.XXXXXX (deleted)`), not its own."""
    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    inodes = {}
    for name in names:
        try:
            inodes[os.stat(os.path.join(directory, name)).st_ino] = name
        except FileNotFoundError:  # removed meanwhile: not left
            continue
    found: set[str] = set()
    for pid in psutil.pids():
        if pid in mine:
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = [line.split(maxsplit=5) for line in maps if directory in line]
        except OSError:  # gone, or not ours to read
            continue
        found |= {inodes[int(fields[4])] for fields in lines if len(fields) > 4 and int(fields[4]) in inodes}
    return found


def left_behind(before: set[str], now: set[str], directory: str = "/dev/shm") -> set[str]:
    """The files of `now` not in `before` that no neighbour holds mapped."""
    new = now - before
    return new - mapped_outside(new, directory) if new else new
