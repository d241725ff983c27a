"""`cache_dir` (colo_data/io/disk_cache.py) is read as data only, and only where no one else
could have written it: a pickle planted in it never runs; a directory or file that another
user owns, or that its group or others may write, is a ConfigError that says what to do; the
directory is made 0700 whatever the umask; the entries stay within the byte limit, the
least recently used going first. (Its use on object storage: tests/test_object_storage.py.)"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Iterator
from pathlib import Path

import diskcache
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import colo_data as cd
from colo_data.io.disk_cache import DiskCache

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

MB = 2**20
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")


class Planted:
    """What unpickling runs: it creates the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


@pytest.fixture
def umask_000() -> Iterator[None]:
    """The process's umask is 000 for the test (as some containers run)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_planted_pickle_never_runs(tmp_path: Path) -> None:
    """A pickle put in the cache directory, as a diskcache entry under the key that is read
    or in place of the cache's own files, is never loaded: the read finds no entry."""
    directory, marker = tmp_path / "cache", tmp_path / "ran"
    DiskCache(directory, MB).put("key", b"fetched bytes")
    for path in directory.rglob("*.entry"):
        path.write_bytes(pickle.dumps(Planted(marker)))
    with diskcache.Cache(str(directory)) as planted:  # how a diskcache directory holds a value that is not bytes
        planted.set("key", Planted(marker))
    assert DiskCache(directory, MB).get("key") is None
    assert not marker.exists(), "the planted pickle ran"


def test_the_directory_is_made_0700_and_its_files_0600_under_umask_000(tmp_path: Path, umask_000: None) -> None:
    directory = tmp_path / "made" / "for" / "cache"
    cache = DiskCache(directory, MB)
    cache.put("key", b"bytes")
    assert cache.get("key") == b"bytes"
    for made in (tmp_path / "made", tmp_path / "made" / "for", directory):
        assert mode(made) == 0o700, (made, oct(mode(made)))
    files = list(directory.iterdir())
    assert files and all(mode(f) == 0o600 for f in files), {f.name: oct(mode(f)) for f in files}


@pytest.mark.parametrize(("bits", "who"), [(0o020, "its group"), (0o002, "others"), (0o022, "its group and others")])
def test_a_directory_or_file_that_others_may_write_is_refused(tmp_path: Path, bits: int, who: str) -> None:
    directory = tmp_path / "cache"
    DiskCache(directory, MB).put("key", b"bytes")
    directory.chmod(0o700 | bits)
    with pytest.raises(cd.errors.ConfigError, match=rf"cache_dir='{directory}': the directory is writable by {who} .*chmod go-w"):
        DiskCache(directory, MB)
    with pytest.raises(cd.errors.ConfigError, match="the directory is writable by"):  # through the source that takes the setting
        cd.ArrowSource(parquet(tmp_path), cache_dir=directory)
    directory.chmod(0o755)
    entry = next(directory.glob("*.entry"))
    entry.chmod(0o600 | bits)
    with pytest.raises(cd.errors.ConfigError, match=rf"the file {entry.name} is writable by {who}"):
        DiskCache(directory, MB)


def test_a_file_made_writable_under_a_running_cache_is_refused_when_read(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    cache = DiskCache(directory, MB)
    cache.put("key", b"bytes")
    next(directory.glob("*.entry")).chmod(0o666)
    with pytest.raises(cd.errors.ConfigError, match="is writable by its group and others"):
        cache.get("key")


@as_root
def test_a_directory_or_file_of_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    DiskCache(directory, MB).put("key", b"bytes")
    os.chown(directory, NOBODY, NOBODY)
    with pytest.raises(cd.errors.ConfigError, match=rf"the directory belongs to uid {NOBODY}, not to this process's user"):
        DiskCache(directory, MB)
    os.chown(directory, 0, 0)
    entry = next(directory.glob("*.entry"))
    os.chown(entry, NOBODY, NOBODY)
    with pytest.raises(cd.errors.ConfigError, match=rf"the file {entry.name} belongs to uid {NOBODY}"):
        DiskCache(directory, MB)


def test_entries_stay_within_the_limit_least_recently_used_first(tmp_path: Path) -> None:
    """20 entries of 1 kB under a limit of 10 kB: the cache never holds more than the limit,
    keeps the entry read after every write, and the last written; a second process's
    handle (a copy) shares the same entries."""
    directory = tmp_path / "cache"
    cache = DiskCache(directory, 10_000)
    for i in range(20):
        cache.put(f"k{i}", bytes([i]) * 1000)
        assert cache.get("k0") == bytes([0]) * 1000
        held = sum(f.stat().st_size for f in directory.glob("*.entry"))
        assert held <= 10_000, (i, held)
    assert cache.get("k19") == bytes([19]) * 1000
    assert cache.get("k1") is None, "the least recently used went first"
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.get("k0") == bytes([0]) * 1000
    cache.put("big", b"x" * 20_000)  # larger than the whole cache: not kept
    assert cache.get("big") is None


def parquet(tmp_path: Path) -> str:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": [1, 2]}), path)
    return str(path)
