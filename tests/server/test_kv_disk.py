"""`radixserve serve --kv-disk-dir` as a subprocess: the cache survives a restart (SIGTERM
saves it, the next start restores it: the system prompt hits on the first request), a
flipped byte in a page file is recomputed (the reply equals the uncached one in fp32, the
corrupt-page counter is 1), and a directory written with another page size is left untouched
(one line says why). `kill -9` at each named crash point (mid save included: its page
writes and its compaction) is in test_kv_disk_crash.py, on a tiny model.

Every wait is on an event: a line the server prints, a reply, page files appearing.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.storage.store_index import decode_index
from tests.server import http
from tests.server.conftest import DTYPE, MODEL
from tests.server.test_sigterm import read_until

PAGE_SIZE = 4
SYSTEM = ("You are the front desk of a mountain hotel. Answer in one short sentence, "
          "mention the season, and never invent prices or room numbers. ") * 3


class Server:
    def __init__(self, directory: Path, *extra: str):
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0", "--model",
               MODEL, "--dtype", DTYPE, "--device", "cpu", "--kv-cache-tokens", "4096",
               "--page-size", str(PAGE_SIZE), "--kv-disk-dir", str(directory),
               "--debug-invariants", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _, self.lines = read_until(self.proc, r"KV pool: ")
        line = self.proc.stdout.readline()              # the disk store's line, if in use
        self.lines.append(line)
        m = re.search(r"KV disk store .*: restored (\d+) tokens", line)
        self.restored = int(m.group(1)) if m else None
        self.url = next(re.search(r"on (http://127\.0\.0\.1:\d+)", x).group(1)
                        for x in self.lines if "serving" in x)

    def ask(self, question: str, system: str = SYSTEM) -> tuple[list[int], int]:
        """Greedy reply token ids and cached prompt tokens of a chat request."""
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "logprobs": True,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}
        reply = http.post(self.url + "/v1/chat/completions", json=body, timeout=300)
        assert reply.status == 200, reply.text
        data = reply.json()
        text = data["choices"][0]["message"]["content"]
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        return text, cached

    def stats(self) -> dict:
        return http.get(self.url + "/cache/stats").json()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=300) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.timeout(1200)          # three server starts on a loaded 2-core machine
def test_restart_restores_the_system_prompt_and_a_flipped_byte_is_recomputed(tmp_path):
    kv = tmp_path / "kv"
    first = Server(kv)
    try:
        fresh_b, cached = first.ask("Is the pool open in winter?")   # nothing cached yet
        assert cached == 0
        _, system_hit = first.ask("When does the ski season start?")
        assert system_hit > len(SYSTEM) // 8       # the system prompt, from memory
        first.stop()
    finally:
        first.kill()
    second = Server(kv)
    try:
        assert second.restored > 0
        _, cached = second.ask("Do you have rooms with a view?")   # the first request
        # The system prompt, from disk: restored as disk-tier nodes, its whole pages are
        # loaded (a partial last page is not copied from outside the pool).
        assert cached == system_hit - system_hit % PAGE_SIZE
        assert second.stats()["kv_disk"]["corrupt_pages"] == 0
        second.stop()
    finally:
        second.kill()
    # A page in the middle of the system prompt (the index's first node under the root):
    # on the path of every question.
    index = decode_index((kv / "index.bin").read_bytes())
    head = next(n for n in index.nodes if n.parent_id is None)
    victim = kv / "pages" / f"{head.page_keys[len(head.page_keys) // 2]:016x}.page"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x04
    victim.write_bytes(bytes(data))
    third = Server(kv)
    try:
        reply, cached = third.ask("Is the pool open in winter?")
        assert reply == fresh_b                    # as computed without any cache (fp32)
        stats = third.stats()["kv_disk"]
        assert stats["corrupt_pages"] == 1
        metrics = http.get(third.url + "/metrics").text
        assert re.search(r"^radixserve_kv_disk_corrupt_pages_total 1\.0$", metrics, re.M)
        third.stop()
    finally:
        third.kill()


def test_another_page_size_leaves_the_directory_untouched(tmp_path):
    kv = tmp_path / "kv"
    first = Server(kv)
    try:
        first.ask("Is breakfast included?")
        first.stop()
    finally:
        first.kill()
    before = snapshot(kv)
    other = Server(kv, "--page-size", "8")
    try:
        said = [line for line in other.lines if "not used" in line]
        assert len(said) == 1 and "page size 4 there, 8 here" in said[0], other.lines
        assert other.restored is None             # no disk store line: the tier is off
        other.ask("Is breakfast included?")
        assert other.stats()["kv_disk"] is None
        other.stop()
    finally:
        other.kill()
    assert snapshot(kv) == before
