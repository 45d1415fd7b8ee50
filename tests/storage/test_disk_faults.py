"""DiskFaults on its own: kinds from errno, one log line per kind, the write pause and its
probe, on a fake clock."""

from __future__ import annotations

import errno
import logging

from radixserve.storage.disk_faults import DiskFaults, FsyncFailed, write_fault_kind


def test_kinds_come_from_errno():
    assert write_fault_kind(OSError(errno.ENOSPC, "full")) == "no_space"
    assert write_fault_kind(OSError(errno.EDQUOT, "quota")) == "no_space"
    assert write_fault_kind(OSError(errno.EROFS, "ro")) == "read_only"
    assert write_fault_kind(OSError(errno.EACCES, "denied")) == "read_only"
    assert write_fault_kind(OSError(errno.EIO, "io")) == "write_error"
    assert write_fault_kind(FsyncFailed(errno.EIO, "fsync")) == "fsync_error"


def test_writes_pause_after_a_fault_and_probe_after_retry_s(caplog):
    now = [100.0]
    faults = DiskFaults("/kv", retry_s=2.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    assert faults.may_write()
    for _ in range(3):
        faults.write_failed(OSError(errno.ENOSPC, "full"), "/kv/pages/1.page")
    assert faults.counts["no_space"] == 3 and faults.paused_kind == "no_space"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "no_space" in logged[0] and "/kv/pages/1.page" in logged[0]
    assert not faults.may_write() and not faults.may_write()
    assert faults.skipped_writes == 2
    now[0] += 2.0
    assert faults.may_write()               # the probe
    faults.write_ok()
    assert faults.paused_kind is None and faults.may_write()
    assert "resumed" in caplog.records[-1].getMessage()
    faults.read_failed(OSError(errno.EIO, "io"), "/kv/pages/2.page")
    assert faults.may_write()               # reads never pause writes
    assert faults.as_dict() == {"faults": {"no_space": 3, "read_only": 0, "write_error": 0,
                                           "fsync_error": 0, "read_error": 1, "queue_full": 0},
                                "skipped_writes": 2, "writes_paused": None}
