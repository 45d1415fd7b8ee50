#!/usr/bin/env python3
"""Online serving benchmark: what the prefix cache buys a running server, measured.

Sends a workload to a running radixserve (or any OpenAI-compatible server) on 127.0.0.1
through its streaming OpenAI API and reports throughput (requests/s, tokens/s), time to
first token and inter-token latency percentiles (p50/p90/p99), and the prefix-cache hit
rate twice: from each response's usage.prompt_tokens_details.cached_tokens and from the
server's Prometheus counters (difference before/after the run).

Workloads (docs/replay.md has the details):
  shared-prefix  groups x prompts: a long system prompt per group + a question each,
                 shuffled (SGLang's "generated-shared-prefix"; --sglang-defaults for its sizes)
  multi-turn     conversations whose history grows every turn (sent after each reply)
  few-shot       one long block of examples, many questions
  trace          a hash-id trace (Mooncake style) replayed at its timestamps / --speed;
                 each hash id becomes a run of seeded words, so shared blocks are shared
                 text prefixes

  python scripts/bench_serving.py --url http://127.0.0.1:8000 --workload shared-prefix
  python scripts/bench_serving.py --url http://127.0.0.1:8000 --compare http://127.0.0.1:8001
  python scripts/bench_serving.py --url http://127.0.0.1:8000 --quick     # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import aiohttp
import numpy as np

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
METRIC_QUERIES = "radixserve_prefix_cache_queries_tokens_total"
METRIC_HITS = "radixserve_prefix_cache_hits_tokens_total"

# Short common words: about one token each (with its leading space) for BPE tokenizers,
# so lengths given in tokens are met to within a few percent.
WORDS = ("the of and to in is it you that he was for on are with as his they be at one "
         "have this from or had by hot word but what some we can out other were all there "
         "when up use your how said an each she which do their time if will way about many "
         "then them write would like so these her long make thing see him two has look "
         "more day could go come did number sound no most people my over know water than "
         "call first who may down side been now find any new work part take get place made "
         "live where after back little only round man year came show every good me give "
         "our under name very through just form sentence great think say help low line "
         "differ turn cause much mean before move right boy old too same tell does set "
         "three want air well also play small end put home read hand port large spell add "
         "even land here must big high such follow act why ask men change went light kind "
         "off need house picture try us again animal point mother world near build self "
         "earth father head stand own page should country found answer school grow study "
         "still learn plant cover food sun four between state keep eye never last let "
         "thought city tree cross farm hard start might story saw far sea draw left late "
         "run while press close night real life few north open seem together next white "
         "children begin got walk example ease paper group always music those both mark "
         "often letter until mile river car feet care second book carry took science eat "
         "room friend began idea fish mountain stop once base hear horse cut sure watch "
         "color face wood main enough plain girl usual young ready above ever red list").split()


# ----------------------------------------------------------------------------- workloads

@dataclass
class BenchRequest:
    """One request: a completion prompt, or chat messages; arrival_s is set for traces."""

    prompt: str | None
    max_tokens: int
    messages: list[dict] | None = None
    arrival_s: float | None = None


@dataclass
class Conversation:
    """A multi-turn chat: each user turn is sent after the previous reply, with history."""

    system: str
    user_turns: list[str]
    max_tokens: int


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(0, n)))


@dataclass(frozen=True)
class Sizes:
    """Workload sizes in tokens (approximately: one word of WORDS per token)."""

    groups: int = 4
    prompts_per_group: int = 8
    system_len: int = 512
    question_len: int = 32
    output_len: int = 16
    conversations: int = 4
    turns: int = 4
    turn_len: int = 32
    fewshot_len: int = 1024
    fewshot_questions: int = 16


SGLANG_SIZES = Sizes(groups=64, prompts_per_group=16, system_len=2048, question_len=128,
                     output_len=256)
QUICK_SIZES = Sizes(groups=2, prompts_per_group=3, system_len=64, question_len=8,
                    output_len=4, conversations=2, turns=2, turn_len=8, fewshot_len=96,
                    fewshot_questions=4)


def shared_prefix_workload(sizes: Sizes, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(sizes.groups):
        system = words(rng, sizes.system_len)
        for _ in range(sizes.prompts_per_group):
            reqs.append(BenchRequest(f"{system}\n\nQuestion: {words(rng, sizes.question_len)}"
                                     "\nAnswer:", sizes.output_len))
    rng.shuffle(reqs)
    return reqs


def fewshot_workload(sizes: Sizes, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    examples = []
    total = 0
    while total < sizes.fewshot_len:
        q, a = words(rng, 12), words(rng, 4)
        examples.append(f"Q: {q}\nA: {a}")
        total += 18
    head = "\n\n".join(examples)
    return [BenchRequest(f"{head}\n\nQ: {words(rng, sizes.question_len)}\nA:",
                         sizes.output_len) for _ in range(sizes.fewshot_questions)]


def multiturn_workload(sizes: Sizes, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [Conversation(words(rng, sizes.system_len),
                         [words(rng, sizes.turn_len) for _ in range(sizes.turns)],
                         sizes.output_len) for _ in range(sizes.conversations)]


def trace_workload(path: str, block_size: int, block_words: int, speed: float,
                   time_unit: float, limit: int | None, max_output: int,
                   seed: int) -> list[BenchRequest]:
    """Hash-id trace -> text: each hash id becomes block_words seeded words, so requests
    sharing leading hash ids share a text prefix; the last block is cut in proportion."""
    from radixserve.replay.traces import TraceError, read_trace

    try:
        trace = read_trace(path, "hash", block_size, "stop", limit)
    except TraceError as exc:
        raise SystemExit(f"bench_serving: {exc}") from None
    t0 = min((r.timestamp or 0.0) for r in trace.requests)
    reqs: list[BenchRequest] = []
    for r in trace.requests:
        parts = []
        for i, h in enumerate(r.hash_ids):
            n = block_words
            if i == len(r.hash_ids) - 1:
                tail = r.input_length - i * block_size
                n = max(1, math.ceil(block_words * tail / block_size))
            parts.append(words(random.Random(seed * 1_000_003 + h), n))
        out = max(1, min(r.output_length or max_output, max_output))
        arrival = ((r.timestamp or 0.0) - t0) * time_unit / speed
        reqs.append(BenchRequest(" ".join(parts), out, arrival_s=arrival))
    return reqs


# ----------------------------------------------------------------------------- client

@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass
class ClientConfig:
    url: str
    model: str
    ignore_eos: bool = True
    timeout_s: float = 600.0
    api_key: str | None = None


async def send(session: aiohttp.ClientSession, cfg: ClientConfig, prompt: str | None,
               messages: list[dict] | None, max_tokens: int) -> RequestResult:
    """One streamed request; TTFT at the first content chunk, ITL between later ones."""
    body: dict = {"model": cfg.model, "max_tokens": max_tokens, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if messages is not None:
        body["messages"] = messages
        endpoint = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        endpoint = "/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res = RequestResult(ok=False, start=time.perf_counter())
    last = res.start
    pieces: list[str] = []
    try:
        async with session.post(cfg.url + endpoint, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                now = time.perf_counter()
                text = "".join(_choice_text(c) for c in chunk.get("choices") or ())
                if text:
                    if res.ttft is None:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    pieces.append(text)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.latency = time.perf_counter() - res.start
    res.text = "".join(pieces)
    res.ok = True
    return res


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def scrape_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """The prefix-cache counters from /metrics; None when the server has none."""
    try:
        async with session.get(url + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return parse_counters(text)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str) -> dict[str, float] | None:
    """Sum of every sample of the two prefix-cache counters (over all label sets)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in (METRIC_QUERIES, METRIC_HITS):
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(3))
    return found if len(found) == 2 else None


async def server_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def flush_cache(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.post(url + "/cache/flush",
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


# ----------------------------------------------------------------------------- runner

@dataclass
class RunOptions:
    request_rate: float = math.inf   # requests (or conversations) per second; inf: all now
    max_concurrency: int | None = None
    seed: int = 0
    flush: bool = True
    warmup: int = 1                  # unrelated requests first (first-call costs), unmeasured


async def run_workload(cfg: ClientConfig, workload: list, opts: RunOptions,
                       progress: bool = True) -> dict:
    """Send the workload once; per-request results plus the counters before and after."""
    sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    rng = np.random.default_rng(opts.seed)
    results: list[RequestResult] = []
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(len(w.user_turns) if isinstance(w, Conversation) else 1 for w in workload)
        bar = tqdm(total=total, unit="req", desc=cfg.url, leave=False, file=sys.stderr)

    async with aiohttp.ClientSession() as session:
        if not cfg.model:
            cfg.model = await server_model(session, cfg.url)
        warm_rng = random.Random(opts.seed + 7919)
        for _ in range(opts.warmup):
            await send(session, cfg, "Warm-up: " + words(warm_rng, 32), None, 4)
        flushed = await flush_cache(session, cfg.url) if opts.flush else None
        before = await scrape_counters(session, cfg.url)

        async def one(prompt, messages, max_tokens) -> RequestResult:
            if sem is None:
                res = await send(session, cfg, prompt, messages, max_tokens)
            else:
                async with sem:
                    res = await send(session, cfg, prompt, messages, max_tokens)
            results.append(res)
            if bar is not None:
                bar.update(1)
            return res

        async def conversation(conv: Conversation) -> None:
            history = [{"role": "system", "content": conv.system}]
            for turn in conv.user_turns:
                history.append({"role": "user", "content": turn})
                res = await one(None, list(history), conv.max_tokens)
                if not res.ok:
                    return
                history.append({"role": "assistant", "content": res.text})

        start = time.perf_counter()
        tasks = []
        offset = 0.0
        for item in workload:
            if isinstance(item, BenchRequest) and item.arrival_s is not None:
                offset = item.arrival_s
            elif math.isfinite(opts.request_rate):
                offset += float(rng.exponential(1.0 / opts.request_rate))
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            coro = (conversation(item) if isinstance(item, Conversation)
                    else one(item.prompt, item.messages, item.max_tokens))
            tasks.append(asyncio.create_task(coro))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await scrape_counters(session, cfg.url)
    if bar is not None:
        bar.close()
    return {"results": results, "duration": duration, "before": before, "after": after,
            "flushed": flushed, "model": cfg.model}


# ----------------------------------------------------------------------------- report

def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=float) * 1000.0   # ms
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99)}


def summarize(run: dict) -> dict:
    ok = [r for r in run["results"] if r.ok]
    failed = [r for r in run["results"] if not r.ok]
    dur = run["duration"]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    out = {
        "model": run["model"], "completed": len(ok), "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "duration_s": dur,
        "request_throughput": len(ok) / dur if dur else 0.0,
        "input_token_throughput": prompt / dur if dur else 0.0,
        "output_token_throughput": output / dur if dur else 0.0,
        "total_prompt_tokens": prompt, "total_output_tokens": output,
        "cached_prompt_tokens": cached,
        "hit_rate_usage": cached / prompt if prompt else None,
        "hit_rate_metrics": None,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([r.latency for r in ok]),
        "cache_flushed": run["flushed"],
    }
    before, after = run["before"], run["after"]
    if before and after:
        dq = after[METRIC_QUERIES] - before[METRIC_QUERIES]
        dh = after[METRIC_HITS] - before[METRIC_HITS]
        out["metrics_query_tokens"], out["metrics_hit_tokens"] = dq, dh
        out["hit_rate_metrics"] = dh / dq if dq > 0 else None
    return out


ROWS = [  # (label, getter, higher is better)
    ("requests/s", lambda s: s["request_throughput"], True),
    ("input tokens/s", lambda s: s["input_token_throughput"], True),
    ("output tokens/s", lambda s: s["output_token_throughput"], True),
    ("TTFT p50 ms", lambda s: s["ttft_ms"]["p50"], False),
    ("TTFT p90 ms", lambda s: s["ttft_ms"]["p90"], False),
    ("TTFT p99 ms", lambda s: s["ttft_ms"]["p99"], False),
    ("ITL p50 ms", lambda s: s["itl_ms"]["p50"], False),
    ("ITL p90 ms", lambda s: s["itl_ms"]["p90"], False),
    ("ITL p99 ms", lambda s: s["itl_ms"]["p99"], False),
    ("E2E p50 ms", lambda s: s["e2e_ms"]["p50"], False),
    ("hit rate (usage)", lambda s: s["hit_rate_usage"], True),
    ("hit rate (/metrics)", lambda s: s["hit_rate_metrics"], True),
]


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"


def format_summary(name: str, s: dict) -> str:
    lines = [f"== {name}: {s['completed']} ok, {s['failed']} failed in "
             f"{s['duration_s']:.2f} s (model {s['model']})"]
    for label, get, _ in ROWS:
        v = get(s)
        shown = "-" if v is None else (f"{v:.1%}" if label.startswith("hit") else _fmt(v))
        lines.append(f"  {label:<22} {shown:>12}")
    lines.append(f"  {'prompt / cached tokens':<22} {s['total_prompt_tokens']:>12,d} / "
                 f"{s['cached_prompt_tokens']:,d}")
    for err in s["errors"]:
        lines.append(f"  error: {err}")
    return "\n".join(lines)


def format_compare(a_name: str, a: dict, b_name: str, b: dict) -> str:
    """Side by side; 'advantage' is how many times better the first server is."""
    lines = [f"{'':<22} {'A':>12} {'B':>12} {'A advantage':>12}",
             f"  A = {a_name}", f"  B = {b_name}"]
    for label, get, higher in ROWS:
        va, vb = get(a), get(b)
        if label.startswith("hit"):
            fa = "-" if va is None else f"{va:.1%}"
            fb = "-" if vb is None else f"{vb:.1%}"
            lines.append(f"{label:<22} {fa:>12} {fb:>12} {'':>12}")
            continue
        adv = "-"
        if va and vb:
            adv = f"{(va / vb if higher else vb / va):.2f}x"
        lines.append(f"{label:<22} {_fmt(va):>12} {_fmt(vb):>12} {adv:>12}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

def local_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOCAL_HOSTS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: only http(s) URLs on this machine (127.0.0.1, localhost) are allowed")
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", type=local_url, default="http://127.0.0.1:8000",
                   help="server under test (127.0.0.1 only)")
    p.add_argument("--compare", type=local_url, default=None, metavar="URL2",
                   help="run the same workload against a second server and print ratios")
    p.add_argument("--workload", default="shared-prefix",
                   choices=("shared-prefix", "multi-turn", "few-shot", "trace"))
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--quick", action="store_true", help="a tiny workload: seconds")
    p.add_argument("--sglang-defaults", action="store_true",
                   help="shared-prefix sizes of SGLang's bench_serving (64 groups x 16 "
                   "prompts, 2048 system, 128 question, 256 output tokens)")
    d = Sizes()
    g = p.add_argument_group("workload sizes (tokens, approximately: one word each)")
    g.add_argument("--groups", type=int, default=None, help=f"default {d.groups}")
    g.add_argument("--prompts-per-group", type=int, default=None,
                   help=f"default {d.prompts_per_group}")
    g.add_argument("--system-prompt-len", type=int, default=None,
                   help=f"default {d.system_len}")
    g.add_argument("--question-len", type=int, default=None, help=f"default {d.question_len}")
    g.add_argument("--output-len", type=int, default=None, help=f"default {d.output_len}")
    g.add_argument("--conversations", type=int, default=None,
                   help=f"multi-turn: default {d.conversations}")
    g.add_argument("--turns", type=int, default=None, help=f"multi-turn: default {d.turns}")
    g.add_argument("--turn-len", type=int, default=None, help=f"default {d.turn_len}")
    g.add_argument("--fewshot-len", type=int, default=None, help=f"default {d.fewshot_len}")
    g.add_argument("--fewshot-questions", type=int, default=None,
                   help=f"default {d.fewshot_questions}")
    t = p.add_argument_group("trace workload")
    t.add_argument("--trace", default=None, help="hash-id JSONL trace (Mooncake style)")
    t.add_argument("--block-size", type=int, default=512, help="tokens per hash id")
    t.add_argument("--block-words", type=int, default=8,
                   help="words sent per hash id (default 8: a scaled-down trace)")
    t.add_argument("--speed", type=float, default=1.0, help="replay speed-up factor")
    t.add_argument("--time-unit", choices=("ms", "s"), default="ms",
                   help="unit of the trace's timestamps (Mooncake: ms)")
    t.add_argument("--limit", type=int, default=None, help="first N trace requests")
    t.add_argument("--max-output-len", type=int, default=32,
                   help="cap on each trace request's output tokens")
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (conversations for multi-turn); "
                   "default inf: all at once (the trace keeps its timestamps)")
    r.add_argument("--max-concurrency", type=int, default=4,
                   help="requests in flight at most (0: no limit; default 4)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--warmup", type=int, default=1,
                   help="unmeasured requests sent first, before the flush (default 1)")
    r.add_argument("--no-flush", action="store_true",
                   help="do not flush the server's prefix cache (POST /cache/flush) first")
    r.add_argument("--no-ignore-eos", action="store_true",
                   help="let outputs stop at EOS (default: fixed output lengths)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the results as JSON to PATH ('-' for stdout)")
    p.add_argument("--no-progress", action="store_true")
    return p


def sizes_from_args(args) -> Sizes:
    base = QUICK_SIZES if args.quick else SGLANG_SIZES if args.sglang_defaults else Sizes()
    overrides = {
        "groups": args.groups, "prompts_per_group": args.prompts_per_group,
        "system_len": args.system_prompt_len, "question_len": args.question_len,
        "output_len": args.output_len, "conversations": args.conversations,
        "turns": args.turns, "turn_len": args.turn_len, "fewshot_len": args.fewshot_len,
        "fewshot_questions": args.fewshot_questions}
    return Sizes(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})


def build_workload(args) -> list:
    sizes = sizes_from_args(args)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(sizes, args.seed)
    if args.workload == "few-shot":
        return fewshot_workload(sizes, args.seed)
    if args.workload == "multi-turn":
        return multiturn_workload(sizes, args.seed)
    if not args.trace:
        raise SystemExit("--workload trace needs --trace PATH")
    limit = args.limit if args.limit is not None else (8 if args.quick else None)
    return trace_workload(args.trace, args.block_size, args.block_words, args.speed,
                          1e-3 if args.time_unit == "ms" else 1.0, limit,
                          min(args.max_output_len, sizes.output_len) if args.quick
                          else args.max_output_len, args.seed)


async def _main(args) -> int:
    workload = build_workload(args)
    opts = RunOptions(args.request_rate, args.max_concurrency or None, args.seed,
                      not args.no_flush, args.warmup)
    summaries = {}
    for url in [args.url] + ([args.compare] if args.compare else []):
        cfg = ClientConfig(url, args.model, not args.no_ignore_eos, api_key=args.api_key)
        run = await run_workload(cfg, workload, opts, progress=not args.no_progress)
        summaries[url] = summarize(run)
        print(format_summary(f"{url} [{args.workload}]", summaries[url]))
        if run["flushed"] is False:
            print("  note: the cache could not be flushed first (POST /cache/flush)")
    if args.compare:
        print()
        print(format_compare(args.url, summaries[args.url], args.compare,
                             summaries[args.compare]))
    if args.json:
        doc = {"workload": args.workload, "sizes": asdict(sizes_from_args(args)),
               "request_rate": (args.request_rate if math.isfinite(args.request_rate)
                                else None),
               "max_concurrency": args.max_concurrency, "servers": summaries}
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as fh:
                fh.write(text + "\n")
    return 0 if all(s["failed"] == 0 for s in summaries.values()) else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
