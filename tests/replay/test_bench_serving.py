"""scripts/bench_serving.py against a fake OpenAI-compatible server on 127.0.0.1.

The fake streams one word per chunk and reports cached_tokens as the longest word prefix it
has seen before (and counts the same in its /metrics), so the benchmark's two hit rates,
its throughput and latency numbers, and the growing chat history can all be checked.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

from .helpers import hash_record, write_jsonl

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


bench = load_bench()


class FakeServer:
    """Words are tokens. A prefix cache that never evicts, unless disabled."""

    def __init__(self, cache: bool = True):
        self.cache = cache
        self.seen: list[list[str]] = []
        self.prompts: list[str] = []
        self.queries = self.hits = 0
        self.flushes = 0

    def cached(self, words: list[str]) -> int:
        best = 0
        for old in self.seen:
            n = 0
            while n < min(len(old), len(words) - 1) and old[n] == words[n]:
                n += 1
            best = max(best, n)
        return best if self.cache else 0

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        chat = "messages" in body
        prompt = ("\n".join(f"{m['role']}: {m['content']}" for m in body["messages"])
                  if chat else body["prompt"])
        self.prompts.append(prompt)
        words = prompt.split()
        hit = self.cached(words)
        self.queries += len(words) - 1
        self.hits += hit
        self.seen.append(words)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.002)
            text = f" w{i}"
            choice = ({"index": 0, "delta": {"content": text}} if chat
                      else {"index": 0, "text": text})
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": len(words), "completion_tokens": n,
                 "total_tokens": len(words) + n,
                 "prompt_tokens_details": {"cached_tokens": hit}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def metrics(self, request):
        return web.Response(text=(
            f"# TYPE {bench.METRIC_QUERIES[:-6]} counter\n"
            f"{bench.METRIC_QUERIES} {float(self.queries)}\n"
            f"{bench.METRIC_HITS} {float(self.hits)}\n"))

    async def flush(self, request):
        self.seen.clear()
        self.flushes += 1
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/cache/flush", self.flush)
        return app


@pytest.fixture
def serve():
    """Start fake servers on 127.0.0.1 in a background loop; yields a starter."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners = []

    def start(server: FakeServer) -> str:
        async def up():
            runner = web.AppRunner(server.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            return runner.addresses[0][1]
        port = asyncio.run_coroutine_threadsafe(up(), loop).result(30)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def run_bench(tmp_path, *argv, warmup: int = 0) -> dict:
    out = tmp_path / "bench.json"
    code = bench.main([*argv, "--json", str(out), "--no-progress", "--warmup", str(warmup)])
    assert code == 0
    return json.loads(out.read_text())


def test_shared_prefix_quick(serve, tmp_path, capsys):
    fake = FakeServer()
    url = serve(fake)
    doc = run_bench(tmp_path, "--url", url, "--quick", "--max-concurrency", "2")
    s = doc["servers"][url]
    assert s["completed"] == 2 * 3 and s["failed"] == 0
    assert s["model"] == "fake-model" and s["cache_flushed"] is True
    assert s["total_output_tokens"] == 6 * 4
    # Both hit rates are the fake's own counts.
    assert s["cached_prompt_tokens"] == fake.hits
    assert s["hit_rate_metrics"] == pytest.approx(fake.hits / fake.queries)
    assert s["hit_rate_usage"] == pytest.approx(fake.hits / s["total_prompt_tokens"])
    # Each group's system prompt (64 words) is cached for all but its first prompt.
    assert fake.hits >= 2 * 2 * 64
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] >= 1.0   # 2 ms between chunks
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
    assert s["request_throughput"] == pytest.approx(6 / s["duration_s"])
    assert "TTFT p50 ms" in capsys.readouterr().out


def test_warmup_is_not_measured(serve, tmp_path):
    fake = FakeServer()
    url = serve(fake)
    doc = run_bench(tmp_path, "--url", url, "--quick", "--workload", "few-shot", warmup=2)
    s = doc["servers"][url]
    assert s["completed"] == 4 and len(fake.prompts) == 2 + 4
    assert all(p.startswith("Warm-up:") for p in fake.prompts[:2])
    assert fake.flushes == 1                       # after the warm-up, before the run
    measured = fake.prompts[2:]
    assert s["total_prompt_tokens"] == sum(len(p.split()) for p in measured)


def test_compare_prints_ratios(serve, tmp_path, capsys):
    on, off = FakeServer(cache=True), FakeServer(cache=False)
    url_on, url_off = serve(on), serve(off)
    doc = run_bench(tmp_path, "--url", url_on, "--compare", url_off, "--quick",
                    "--workload", "few-shot")
    assert on.prompts == off.prompts                  # the same workload, twice
    assert doc["servers"][url_on]["hit_rate_usage"] > 0.5
    assert doc["servers"][url_off]["hit_rate_usage"] == 0
    out = capsys.readouterr().out
    assert "A advantage" in out and "TTFT p50 ms" in out


def test_multi_turn_history_grows(serve, tmp_path):
    fake = FakeServer()
    url = serve(fake)
    doc = run_bench(tmp_path, "--url", url, "--quick", "--workload", "multi-turn",
                    "--turns", "3")
    assert doc["servers"][url]["completed"] == 2 * 3
    for conv in range(2):
        turns = [p for p in fake.prompts if p.startswith(fake.prompts[conv].split("\n")[0])]
        turns.sort(key=len)
        assert len(turns) == 3
        for a, b in zip(turns, turns[1:]):
            assert b.startswith(a) and " w0 w1 w2 w3" in b[len(a):]   # the reply is kept


def test_trace_workload_shares_text_where_blocks_are_shared(serve, tmp_path):
    trace = write_jsonl(tmp_path / "t.jsonl", [
        hash_record([1, 2], 1000, 3, timestamp=0), hash_record([1, 3], 1000, 3, timestamp=50),
        hash_record([4], 10, 3, timestamp=100)])
    reqs = bench.trace_workload(str(trace), 512, 8, speed=10.0, time_unit=1e-3, limit=None,
                                max_output=2, seed=0)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.005, 0.01])
    a, b, c = (r.prompt.split() for r in reqs)
    assert a[:8] == b[:8] and a[8:] != b[8:]          # block 1 shared, then not
    assert len(a) == 8 + 8 and len(c) == 1           # 488/512 of a block -> 8 words; 10 -> 1
    assert all(r.max_tokens == 2 for r in reqs)
    fake = FakeServer()
    url = serve(fake)
    doc = run_bench(tmp_path, "--url", url, "--workload", "trace", "--trace", str(trace),
                    "--speed", "100")
    assert doc["servers"][url]["completed"] == 3
    assert doc["servers"][url]["cached_prompt_tokens"] == 8


def test_only_local_urls(capsys):
    for bad in ("http://example.com:8000", "http://10.0.0.1:8000", "ftp://127.0.0.1"):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(["--url", bad])
    assert "only http(s) URLs on this machine" in capsys.readouterr().err
    assert bench.build_parser().parse_args(["--url", "http://localhost:9/"]).url == \
        "http://localhost:9"


def test_counter_parsing():
    text = (f"# HELP x\n{bench.METRIC_QUERIES} 10.0\n{bench.METRIC_HITS}{{a=\"1\"}} 3\n"
            f"{bench.METRIC_HITS}{{a=\"2\"}} 4\nother_total 99\n")
    assert bench.parse_counters(text) == {bench.METRIC_QUERIES: 10.0, bench.METRIC_HITS: 7.0}
    assert bench.parse_counters("nothing 1\n") is None
