"""The files under a local directory as a dataset source reads them: hidden and underscore
directories left out (a Spark `_temporary`, a filer's `.snapshot`, `.ipynb_checkpoints`),
links to directories followed once each and never back into the tree, and every real
file (device and inode) named by one path. pyarrow's own recursive listing follows every
link: a link to a sibling reads its files twice, and one to `.` loops."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Iterable

import pyarrow.fs as pafs

from colo_data.errors import SourceError

HIDDEN = (".", "_")  # a path part that starts with one of these is not the dataset's (pyarrow.dataset, Spark, Hive)


def hidden(part: str) -> bool:
    """Whether a directory or file name hides what it names from a dataset listing."""
    return part.startswith(HIDDEN)


def local_files(root: str, keep_dir: Callable[[str], bool]) -> list[pafs.FileInfo]:
    """Every file under the local directory `root`, recursively, each real file once.

    The tree's own directories are walked first; then the directories that links in it
    name, each once, in sorted order of the links (a link to a directory already walked
    adds nothing). A directory whose name `keep_dir` refuses (relative to `root`) is not
    entered. A file reached by several paths (links, hard links) is named by its path
    without links where it has one, else by the first in sorted order.

    A link whose target is gone is listed as pyarrow lists it (`FileType.NotFound`).

    Raises:
        SourceError: a link that names an ancestor of `root` (following it would read
            outside the tree, and the tree again): names the link, says to remove it.
    """
    top = os.stat(root)
    walked = {(top.st_dev, top.st_ino)}
    files: dict[tuple[int, int], list[tuple[str, os.stat_result]]] = {}
    links: list[str] = []
    broken: list[pafs.FileInfo] = []
    pending = [root]
    while pending or links:
        if not pending:  # the tree itself is walked: follow the first link whose directory is not
            link = links.pop(0)
            target = os.stat(link)
            if (target.st_dev, target.st_ino) in walked:
                continue
            _refuse_ancestor(link, root)
            walked.add((target.st_dev, target.st_ino))
            pending.append(link)
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) or (entry.is_symlink() and entry.is_dir()):
                    if not keep_dir(posixpath.relpath(entry.path, root)):
                        continue
                    if entry.is_symlink():
                        links.append(entry.path)
                        continue
                    st = entry.stat()
                    if (st.st_dev, st.st_ino) not in walked:
                        walked.add((st.st_dev, st.st_ino))
                        pending.append(entry.path)
                elif entry.is_file():  # a file, or a link to one
                    st = entry.stat()
                    files.setdefault((st.st_dev, st.st_ino), []).append((entry.path, st))
                elif entry.is_symlink():  # its target is gone: listed as pyarrow lists it, the caller decides
                    broken.append(pafs.FileInfo(entry.path, pafs.FileType.NotFound))
        links.sort()
    chosen = sorted(_preferred(named) for named in files.values())
    return [pafs.FileInfo(p, pafs.FileType.File, mtime_ns=st.st_mtime_ns, size=st.st_size) for p, st in chosen] + broken


def distinct(paths: Iterable[str]) -> list[str]:
    """`paths` (local files) with each real file once, by the rule of `local_files`."""
    by_file: dict[tuple[int, int], list[tuple[str, os.stat_result]]] = {}
    for path in paths:
        st = os.stat(path)
        by_file.setdefault((st.st_dev, st.st_ino), []).append((path, st))
    return sorted(_preferred(named)[0] for named in by_file.values())


def _preferred(named: list[tuple[str, os.stat_result]]) -> tuple[str, os.stat_result]:
    """Of the paths of one file, the one without links (its real path), else the first."""
    return min(named, key=lambda n: (os.path.realpath(n[0]) != n[0], n[0]))


def _refuse_ancestor(link: str, root: str) -> None:
    target, real_root = os.path.realpath(link), os.path.realpath(root)
    if real_root == target or real_root.startswith(target.rstrip("/") + "/"):
        raise SourceError(
            f"{link} is a link to {target}, which holds the dataset's directory {root}: following it would read "
            "the dataset again and whatever lies beside it. Remove the link, or give the source the directories "
            "to read."
        )
