#!/usr/bin/env python3
"""Screenshot of the cache view (GET /ui) after a few dozen shared-prefix requests, for docs/.

Starts `radixserve serve --ui-show-text` on the default model with a small KV pool (so
occupancy and eviction show), opens the page in headless
Chromium (the system's, driven by Playwright), sends bench_serving.py's shared-prefix
workload at a steady rate while the page watches, asks two questions in the chat box with
the same system prompt, then, while one more request with that system prompt decodes (so
its path shows locked), points at the chat's prefix and saves a full-page PNG.

  python scripts/ui_screenshot.py --out docs/cache_view.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from ui_server import ROOT, running_server

def chat(page, text: str) -> None:
    before = page.locator(".msg.assistant").count()
    page.fill("#chat-input", text)
    page.click("#chat-send")
    page.wait_for_function(f"() => document.querySelectorAll('.msg.assistant').length > {before}")


def long_request(url: str, model: str, system: str) -> threading.Thread:
    """A chat with the page's system prompt that decodes for a while, in the background."""
    body = {"model": model, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Describe every bread you bake."}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})

    def send() -> None:
        try:
            urllib.request.urlopen(req, timeout=600).read()
        except OSError:
            pass                               # the server stops under it: expected

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/cache_view.png")
    p.add_argument("--chromium", default=os.environ.get("RADIXSERVE_CHROMIUM")
                   or shutil.which("chromium") or shutil.which("chromium-browser"))
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=1.5)
    p.add_argument("--width", type=int, default=1440)
    p.add_argument("--height", type=int, default=1200)
    p.add_argument("--kv-cache-tokens", type=int, default=1536)
    args = p.parse_args()
    if not args.chromium:
        raise SystemExit("no Chromium: apt-get install -y chromium, or --chromium PATH")
    from playwright.sync_api import sync_playwright

    with running_server(["--ui-show-text", "--kv-cache-tokens", str(args.kv_cache_tokens),
                         "--shutdown-grace-s", "1"]) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        page.set_default_timeout(600_000)
        page.goto(url + "/ui")
        page.wait_for_function("() => document.getElementById('status').dataset.state === 'live'")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--url", url,
                        "--workload", "shared-prefix", "--groups", str(args.groups),
                        "--prompts-per-group", str(args.prompts_per_group),
                        "--system-prompt-len", "160", "--question-len", "24",
                        "--output-len", "12", "--request-rate", str(args.request_rate),
                        "--no-progress"], check=True)
        chat(page, "What bread do you bake today?")
        page.click("#chat-reset")
        chat(page, "Do you sell lemon cakes?")
        model = page.get_attribute('meta[name="radixserve-model"]', "content")
        long_request(url, model, page.input_value("#chat-system"))
        page.wait_for_function("() => radixUI.tree && radixUI.tree.nodes.some(e => e.locked)")
        # point at the chat's prefix (the chat template and system prompt): its text shows
        chat_prefix = page.locator('#tree rect[data-kind="node"][data-depth="2"]').last
        box = chat_prefix.bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] / 2)
        out = Path(args.out)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
