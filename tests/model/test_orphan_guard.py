"""orphan_guard: a worker started with a stdin pipe ends when its parent is killed, and
the decode compile's child (model/compiled_decode.py) with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import hf_config, random_hf_model, save_hf_dir

from radixserve.model.orphan_guard import ORPHANED_EXIT

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120        # a bound on the wait for an event, not a guess at its time

# The worker: guarded, then asleep far longer than any test.
WORKER = ("from radixserve.model.orphan_guard import exit_with_parent; exit_with_parent(); "
          "print('ready', flush=True); import time; time.sleep(3600)")
# The parent (a stand-in for the server): starts the worker as compiled_decode does,
# says its pid once the worker runs, then waits to be killed.
PARENT = ("import subprocess, sys, time; "
          f"w = subprocess.Popen([sys.executable, '-c', {WORKER!r}], stdin=subprocess.PIPE, "
          "stdout=subprocess.PIPE, text=True); "
          "assert w.stdout.readline() == 'ready\\n'; "
          "print(w.pid, flush=True); time.sleep(3600)")

# An engine's process on a cold compile cache (--decode-compile on): it starts the compile
# child, says its pid, then waits to be killed.
ENGINE = """
import sys, time
sys.path.insert(0, {helpers!r})
from engine_helpers import make_engine
from radixserve.model import load_model
loaded = load_model({model!r}, dtype="float32", weights_dtype="int4")
engine = make_engine(loaded, decode_compile="on", weights_cache_dir={cache!r})
print(engine.runner.compiled_decode.compiling_pid, flush=True)
time.sleep(3600)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to see the worker end")


def _gone(pid: int) -> bool:
    """The process ended: reaped (no /proc entry) or a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.02)
    return False


def test_a_worker_ends_when_its_parent_is_killed():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE,
                              text=True, env=env)
    worker = int(parent.stdout.readline())
    try:
        assert not _gone(worker)            # running, guarded
        parent.send_signal(signal.SIGKILL)  # no chance to stop its worker
        assert parent.wait(DEADLINE_S) == -signal.SIGKILL
        assert _wait_gone(worker), "the worker outlived its killed parent"
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_exits_when_its_parent_closes_the_pipe():
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert worker.stdout.readline() == "ready\n"
        assert worker.poll() is None
        worker.stdin.close()                # what the parent's end does to it
        assert worker.wait(DEADLINE_S) == ORPHANED_EXIT
    finally:
        if worker.poll() is None:
            worker.kill()


def test_a_killed_engine_leaves_no_compile_running(tmp_path):
    model = save_hf_dir(tmp_path / "tiny", random_hf_model(hf_config("llama")))
    script = ENGINE.format(helpers=str(REPO / "tests" / "engine"), model=str(model),
                           cache=str(tmp_path / "cache"))
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = engine.stdout.readline().strip()
    try:
        assert line.isdigit(), f"no compile started: {line!r}"
        compiling = int(line)
        assert not _gone(compiling)
        engine.send_signal(signal.SIGKILL)
        assert engine.wait(DEADLINE_S) == -signal.SIGKILL
        assert _wait_gone(compiling), "the compile outlived its killed engine"
        # Ended by the guard, not by finishing (a tiny model compiles in ~15 s): no step.
        assert not list((tmp_path / "cache").rglob("*.so"))
    finally:
        if engine.poll() is None:
            engine.kill()
        if line.isdigit() and not _gone(int(line)):
            os.kill(int(line), signal.SIGKILL)
