"""The cache view in a real headless Chromium against a live server on the real model:
the page loads with no console errors, the tree and charts render, two chats with the same
system prompt hit the cache and the hit-rate series rises; with --api-key the page asks for
the key, keeps it in the tab, and the data routes refuse requests without it.

Every wait is on a condition in the page (Playwright polls it), bounded only by a generous
timeout that fails the test: nothing sleeps a guessed number of seconds. Conditions are
written as functions (`() => ...`): the page's Content-Security-Policy forbids eval, which
Playwright would use for a bare expression.
"""

from __future__ import annotations

import pytest

from radixserve.server.app import ServerConfig
from radixserve.server.auth import AuthConfig
from tests.browser.conftest import live_server
from tests.browser.client import KNOWN_PROMPTS, complete

WAIT_MS = 180_000          # a failure bound for a busy machine, not an expected duration

TOP_LEVEL = 'document.querySelectorAll(\'#tree rect[data-kind="node"][data-depth="2"]\').length'
FINISHED = "(radixUI.snapshots.at(-1) || {engine: {requests_finished: -1}}).engine.requests_finished"
# Pixels a chart canvas has drawn (axes, grid and lines): 0 for a blank canvas.
PAINTED = """() => Array.from(document.querySelectorAll('.chart canvas')).map(c => {
  const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0; for (let i = 3; i < data.length; i += 4) if (data[i]) n++; return n; })"""


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/ui")
    return page, errors


def wait_until(page, condition: str) -> None:
    page.wait_for_function(f"() => {condition}")


def chat(page, text: str) -> int:
    """Send one message through the chat box; its reply's cached_tokens."""
    before = page.locator(".msg.assistant").count()
    page.fill("#chat-input", text)
    page.click("#chat-send")
    wait_until(page, f"document.querySelectorAll('.msg.assistant').length > {before}"
                     " || document.querySelector('.msg.error') !== null")
    assert page.locator(".msg.error").count() == 0, page.locator(".msg.error").inner_text()
    return int(page.locator(".msg.assistant").last.get_attribute("data-cached-tokens"))


@pytest.fixture(scope="module")
def server(model_fp32):
    with live_server(model_fp32) as srv:
        yield srv


def test_page_shows_tree_charts_and_a_chat_that_hits(server, browser):
    for prompt in KNOWN_PROMPTS:                 # three prompts, three different first tokens
        complete(server, prompt)
    server.wait_idle()
    page, errors = open_page(browser, server.url)
    try:
        wait_until(page, f"{TOP_LEVEL} === {len(KNOWN_PROMPTS)}")
        assert page.locator("#status").get_attribute("data-state") == "live"
        wait_until(page, "radixUI.snapshots.length >= 3")
        painted = page.evaluate(PAINTED)
        assert len(painted) == 6 and all(n > 500 for n in painted), painted
        series = page.evaluate("radixUI.series")
        assert len(series["x"]) >= 3 and series["pool"][0][-1] > 0      # free pages plotted
        assert series["hit"][0][-1] == 0                                 # no hit yet

        # hovering a prefix names it by hash (no --ui-show-text: no text)
        page.hover('#tree rect[data-kind="node"][data-depth="2"]')
        tip = page.locator("#tooltip")
        assert tip.is_visible() and tip.inner_text().startswith("prefix #")
        assert "hits" in tip.inner_text()

        first = chat(page, "What bread do you bake today?")
        wait_until(page, f"{FINISHED} >= {len(KNOWN_PROMPTS) + 1}")
        rate_before = page.evaluate("radixUI.series.hit[0].at(-1)")
        page.click("#chat-reset")                # a new conversation, the same system prompt
        second = chat(page, "Do you sell cakes?")
        assert second > 0 and second > first, (first, second)
        wait_until(page, f"{FINISHED} >= {len(KNOWN_PROMPTS) + 2}")
        assert page.evaluate("radixUI.series.hit[0].at(-1)") > rate_before
        # the chats share one new top-level prefix: the chat template and system prompt
        wait_until(page, f"{TOP_LEVEL} === {len(KNOWN_PROMPTS) + 1}")
        assert errors == []
    finally:
        page.close()
    server.check_invariants()


def test_with_an_api_key_the_page_asks_for_it_and_data_routes_refuse_without(model_fp32, browser):
    config = ServerConfig(port=0, auth=AuthConfig(("sekrit",)))
    with live_server(model_fp32, config) as srv:
        complete(srv, KNOWN_PROMPTS[0], key="sekrit")
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        try:
            page = context.new_page()
            page.set_default_timeout(WAIT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(srv.url + "/ui")
            assert page.locator("#key-overlay").is_visible()
            statuses = page.evaluate("""async () => Promise.all(
                ['/cache/tree', '/cache/events', '/cache/stats', '/v1/models'].map(async p =>
                    (await fetch(p)).status))""")
            assert statuses == [401, 401, 401, 401]
            assert page.locator("#tree rect").count() == 0   # nothing loaded without the key

            page.fill("#key-input", "wrong")
            page.click("#key-form button")
            wait_until(page, "document.getElementById('key-error').textContent !== ''")
            assert page.locator("#key-overlay").is_visible()

            page.fill("#key-input", "sekrit")
            page.click("#key-form button")
            wait_until(page, f"{TOP_LEVEL} === 1")
            wait_until(page, "document.getElementById('status').dataset.state === 'live'")
            assert page.evaluate("sessionStorage.getItem('radixserve-api-key')") == "sekrit"
            assert page.evaluate("localStorage.length") == 0
            assert chat(page, "Hello?") >= 0                 # the chat box sends the key too
            # another tab of the same browser does not have it
            other = context.new_page()
            other.goto(srv.url + "/ui")
            assert other.locator("#key-overlay").is_visible()
            assert errors == []
        finally:
            context.close()
        srv.check_invariants()
