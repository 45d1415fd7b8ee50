"""`radixserve serve` in a subprocess, for the cache-view scripts (ui_screenshot.py,
bench_ui_cost.py): the server's base URL read from the address line it prints at start."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
PAGE_LINE = re.compile(r"cache view on (http://\S+)/ui")


@contextmanager
def running_server(flags: list[str]) -> Iterator[str]:
    """Start the server on a free port with `flags`; yield its base URL; SIGTERM it after."""
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0",
           "--decode-compile", "off", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    url = None
    for line in proc.stdout:
        print(line, end="", file=sys.stderr)
        if (m := PAGE_LINE.search(line)):
            url = m.group(1)
            break
    if url is None:
        proc.wait()
        raise SystemExit(f"the server exited ({proc.returncode}) before printing its address")
    # keep reading its output so the pipe never fills up
    threading.Thread(target=lambda: [print(x, end="", file=sys.stderr) for x in proc.stdout],
                     daemon=True).start()
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
