"""Fixtures for the cache-view tests: live servers on the real default model and, for the
page tests, a headless Chromium driven by Playwright.

Chromium comes from the system (Debian's `chromium` package, installed by `scripts/dev.sh`
as root) or from $RADIXSERVE_CHROMIUM; Playwright's own browser download is never used.
When either is missing the tests FAIL with the command that fixes it: they are part of the
normal suite and must not pass by being skipped.
"""

from __future__ import annotations

import os
import shutil

import pytest

from radixserve.server.app import ServerConfig
from tests.server.conftest import make_engine
from tests.server.live import LiveServer

CHROMIUM_ENV = "RADIXSERVE_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def live_server(model, config: ServerConfig | None = None, **engine_overrides) -> LiveServer:
    return LiveServer(make_engine(model, **engine_overrides), config or ServerConfig(port=0))


def find_chromium() -> str:
    wanted = os.environ.get(CHROMIUM_ENV)
    candidates = [wanted] if wanted else [shutil.which(name) for name in CHROMIUM_NAMES]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    pytest.fail(
        "Chromium was not found, and the cache-view browser tests need it. Install Debian's "
        "package as root (`apt-get update && apt-get install -y chromium`; `scripts/dev.sh "
        f"setup` does it) or point ${CHROMIUM_ENV} at a Chrome/Chromium binary. "
        f"Looked for: {wanted or ', '.join(CHROMIUM_NAMES)}.", pytrace=False)


@pytest.fixture(scope="module")
def browser():
    """Module-scoped on purpose: Playwright's sync API runs an event loop on this thread
    while it is open, and a session-wide one made every later asyncio.run() fail."""
    path = find_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright for Python is missing: `pip install -e '.[dev]'` (or `pip install "
                    "playwright`). Do not run `playwright install`: the tests use the system "
                    "Chromium.", pytrace=False)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=path, headless=True,
                                      args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield chromium
        finally:
            chromium.close()
