"""The 50-tool agent loop across two server processes (`bench_structured.py --two-processes`).

A first `radixserve serve` runs the loop over HTTP, then stops on SIGTERM (which saves its
KV cache); a second process starts on the same `--kv-disk-dir` and `--grammar-cache-dir`
and runs the loop again, its tools sent in another order. Per turn: prompt and cached
tokens, and the share of the tool block (the system message with the 50 tools) that hit.
Per server: grammars compiled, read from disk and prewarmed (from /metrics): the second
server's forced-call grammar should be prewarmed, with nothing compiled; and its KV disk
store's log lines (tokens restored at start, the shutdown save's report: `complete` false
means the grace ran out before every page was written).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from radixserve.model.tokenizer_loader import load_tokenizer
from radixserve.server.tools import parse_tools, render_messages

MODEL = "smollm2-135m-instruct"
GRAMMAR_METRICS = ("radixserve_grammar_compiles_total", "radixserve_grammar_cache_misses_total",
                   "radixserve_grammar_prewarmed_total")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.load(r)


def _grammar_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    found = {}
    for name in GRAMMAR_METRICS:
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        found[name.removeprefix("radixserve_grammar_").removesuffix("_total")] = \
            float(m.group(1)) if m else None
    return found


def _start(kv_dir: Path, grammar_dir: Path, disk_lines: list[str]
           ) -> tuple[subprocess.Popen, str, threading.Thread]:
    """A server on the shared directories; its log lines about the KV disk store (what it
    restored, what its shutdown saved) are collected in `disk_lines`."""
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0",
           "--decode-compile", "off", "--model", MODEL,
           "--dtype", "float32", "--device", "cpu", "--kv-disk-dir", str(kv_dir),
           "--grammar-cache-dir", str(grammar_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def keep(line: str) -> None:
        if "KV disk store" in line:
            disk_lines.append(line.strip())
    for line in iter(proc.stdout.readline, ""):      # type: ignore[union-attr]
        keep(line)
        m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
        if m:
            rest = proc.stdout                          # type: ignore[union-attr]
            reader = threading.Thread(target=lambda: [keep(x) for x in rest], daemon=True)
            reader.start()
            return proc, m.group(1), reader
    raise SystemExit(f"the server exited: {proc.wait()}")


def _tool_block_tokens(tools: list[dict]) -> int:
    tok = load_tokenizer(MODEL)
    msgs, _ = render_messages([], [], parse_tools(tools), native=False)
    return len(tok.apply_chat_template(msgs, add_generation_prompt=False))


def _loop(url: str, tools: list[dict], turns: int, label: str, block: int) -> list[dict]:
    """Each turn a forced call (tool_choice required), its tool result, the next ask."""
    messages: list[dict] = [{"role": "user", "content": "Find record 7 for 'alpha'."}]
    rows = []
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "tools": tools,
                "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": 48, "temperature": 0}
        reply = _post(url + "/v1/chat/completions", body)
        usage = reply["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        rows.append({"server": label, "turn": turn + 1, "prompt_tokens": usage["prompt_tokens"],
                     "cached_tokens": cached, "tool_block_tokens": block,
                     "tool_block_hit": round(min(cached, block) / block, 4),
                     "finish_reason": reply["choices"][0]["finish_reason"]})
        message = reply["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        messages.append({k: v for k, v in message.items() if v is not None})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "found: 3 rows"}
                     for c in calls]
        messages.append({"role": "user", "content": f"Now record {turn + 8}, please."})
    return rows


def run(tools: list[dict], turns: int) -> None:
    block = _tool_block_tokens(tools)
    with tempfile.TemporaryDirectory() as d:
        kv_dir, grammar_dir = Path(d) / "kv", Path(d) / "grammars"
        for label in ("first", "second"):
            order = list(tools)
            if label == "second":
                random.Random(0).shuffle(order)     # same tools, another order
            disk_lines: list[str] = []
            proc, url, reader = _start(kv_dir, grammar_dir, disk_lines)
            try:
                for row in _loop(url, order, turns, label, block):
                    print(json.dumps(row), flush=True)
                print(json.dumps({"server": label, "pid": proc.pid,
                                  "grammars": _grammar_metrics(url)}), flush=True)
            finally:
                proc.terminate()                    # SIGTERM: the KV cache is saved
                proc.wait(timeout=600)
                reader.join(60)
            # after the pipe closed: the restore's line and the shutdown save's report
            print(json.dumps({"server": label, "kv_disk_store": disk_lines}), flush=True)
