"""Crash-safe file writes: a temporary file beside the target, fsync, rename, fsync the dir.

A reader (or the next start after a `kill -9` or a power loss) sees either the old file or
the complete new one, never a half-written one; what a crash leaves is at most a stray
`*.tmp`, which the store removes when it next opens the directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from .disk_faults import FsyncFailed

TMP_SUFFIX = ".tmp"


def tmp_path_for(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def write_atomic(path: Path, chunks: Iterable[bytes | bytearray | memoryview],
                 sync_dir: bool = False, before_rename: Callable[[], None] | None = None) -> int:
    """Write `chunks` as `path`'s new content; -> bytes written. The data is fsynced before
    the rename; `sync_dir` also fsyncs the directory, making the rename itself durable
    (callers writing many files do that once, with `fsync_dir`). `before_rename`: a crash
    test's hook (storage/crash_points.py)."""
    tmp = tmp_path_for(path)
    written = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                written += f.write(chunk)
            f.flush()
            fsync_file(f.fileno(), tmp)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return written


def fsync_file(fd: int, path: Path) -> None:
    """fsync, with a failure told apart from other write errors (FsyncFailed): after one,
    the kernel may have dropped the dirty pages, so the file must not be trusted."""
    try:
        os.fsync(fd)
    except OSError as e:
        raise FsyncFailed(e.errno, f"fsync failed: {e.strerror}", str(path)) from e


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (renames, removals) durable (FsyncFailed, as files)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync_file(fd, directory)
    finally:
        os.close(fd)
