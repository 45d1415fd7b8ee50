"""GrammarCompiler: grammars compiled off the event loop and the compute thread, under a time
cap, kept in a bounded in-memory LRU and on disk.

- Memory: the last `memory_entries` grammars (a template matcher each), by cache key.
- Disk: `<cache dir>/grammars/<key>.grammar`, the spec and the library's validated grammar
  in a checked blob (magic, length, CRC32C: the KV pages' framing, storage/checked_blob.py).
  The key (GrammarSpec.key) covers the schema, the tokenizer and the library version, so a
  restarted server skips the schema conversion and validation of every grammar it compiled
  before; a damaged file is ignored and rewritten.
- Prewarm: llguidance cannot serialise a built matcher, so `prewarm` (at server start, on
  the grammar threads) builds the library's tokenizer and the matchers of the most recently
  used disk entries back into memory: a request after a restart then finds its grammar
  built, as if warm, and nothing is compiled on its path.
- The cap: a compile that runs past `timeout_s` is a GrammarTimeout (a 400 upstream); its
  thread finishes on its own (Rust cannot be interrupted) but nobody waits for it, and the
  pool has threads of its own, so no other request or step is held up.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance

from radixserve.engine.grammar import (Grammar, GrammarError, GrammarSpec, MatcherCounter,
                                       validate)
from radixserve.storage.atomic_files import write_atomic
from radixserve.storage.checked_blob import HEADER, BadBlob, check_header, check_payload, pack_header

log = logging.getLogger(__name__)

MAGIC = b"RSGRAMR2"         # payload: JSON {"kind", "source", "grammar"}
COMPILE_THREADS = 2
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_ENTRIES = 256


class GrammarTimeout(GrammarError):
    """Compiling took longer than the cap."""


@dataclass
class GrammarStats:
    """Counters for /metrics."""

    compiles: int = 0               # grammars validated and built from scratch
    compile_seconds: float = 0.0    # all compiles, summed
    memory_hits: int = 0
    disk_hits: int = 0              # validated grammar read from disk; only the matcher built
    misses: int = 0
    refused: int = 0                # unsupported / malformed
    timeouts: int = 0
    prewarmed: int = 0              # matchers built at start from disk entries
    prewarm_seconds: float = 0.0


class GrammarCompiler:
    """One per process that starts requests: the server's, or each Ray replica's (a
    compiled grammar cannot be sent between processes; its spec is, and the shared disk
    cache makes the replica's compile a disk hit)."""

    def __init__(self, tokenizer: Any, cache_dir: Path | None = None,
                 memory_entries: int = DEFAULT_MEMORY_ENTRIES,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.tokenizer = tokenizer          # a model.Tokenizer (its .hf is read on first use)
        self.cache_dir = cache_dir
        self.memory_entries = memory_entries
        self.timeout_s = timeout_s
        self.stats = GrammarStats()
        self.matchers = MatcherCounter()
        self._memory: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_id: str | None = None
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="radixserve-grammar")
        self._closed = False

    def close(self) -> None:
        self._closed = True                 # a running prewarm stops at its next entry
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the library's view of the tokenizer (built once, ~0.4 s) ---------------------

    def _tokenizer(self) -> tuple[llguidance.LLTokenizer, str]:
        """llguidance's tokenizer, built from the HF tokenizer's own JSON (what
        llguidance.hf.from_tokenizer does), and its id: a hash of that JSON and the EOS."""
        with self._lock:
            if self._ll_tokenizer is None:
                hf = self.tokenizer.hf
                eos_ids = sorted(self.tokenizer.eos_token_ids)
                eos = hf.eos_token_id if hf.eos_token_id is not None else (
                    eos_ids[0] if eos_ids else None)
                backend = copy(hf.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                text = backend.to_str()
                self._ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=len(hf),
                                                            eos_token=eos)
                digest = hashlib.sha256(text.encode())
                digest.update(f"\0{eos!r}\0{len(hf)}".encode())
                self._tokenizer_id = digest.hexdigest()[:32]
            return self._ll_tokenizer, self._tokenizer_id  # type: ignore[return-value]

    def prewarm(self, limit: int) -> Future:
        """Build the tokenizer and the `limit` most recently used disk entries' matchers
        into memory, on the grammar threads (the caller does not wait). `limit` 0: the
        tokenizer alone."""
        return self._pool.submit(self._prewarm, limit)

    def _prewarm(self, limit: int) -> int:
        """Nothing when the disk cache is empty (a first start pays nothing extra)."""
        started = time.perf_counter()
        entries = self._recent_entries()
        if limit > 0 and not entries:
            return 0
        tokenizer, tokenizer_id = self._tokenizer()
        loaded = 0
        for path in entries[:4 * limit]:    # other models' entries share the directory
            if loaded >= min(limit, self.memory_entries) or self._closed:
                break
            key = path.stem
            with self._lock:
                if key in self._memory:
                    continue
            entry = self._read(key, warn=False)
            if entry is None or entry[0].key(tokenizer_id) != key:
                continue                    # another tokenizer's or library's entry
            template = llguidance.LLMatcher(tokenizer, entry[1])
            if template.is_error():
                continue
            self._remember(key, Grammar(entry[0], template, self.matchers,
                                        len(self.tokenizer.hf)))
            loaded += 1
        self.stats.prewarmed += loaded
        self.stats.prewarm_seconds += time.perf_counter() - started
        return loaded

    def _recent_entries(self) -> list[Path]:
        if self.cache_dir is None or not self.cache_dir.is_dir():
            return []
        entries = []
        for path in self.cache_dir.glob("*.grammar"):
            try:
                entries.append((path.stat().st_mtime, path))
            except OSError:
                continue
        return [path for _, path in sorted(entries, reverse=True)]

    # -- compiling ---------------------------------------------------------------------

    async def compile(self, spec: GrammarSpec, capped: bool = True) -> Grammar:
        """The grammar for `spec`, from memory, disk or a fresh compile on the grammar
        threads; GrammarError when refused, GrammarTimeout past the cap. `capped=False`:
        a grammar already compiled under the cap by another process (a replica's, whose
        first compile also builds the tokenizer) is waited for."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self.compile_blocking, spec)
        if not capped:
            return await future
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            self.stats.timeouts += 1
            raise GrammarTimeout(f"compiling the grammar took longer than the "
                                 f"{self.timeout_s:g} s cap") from None

    def compile_blocking(self, spec: GrammarSpec) -> Grammar:
        tokenizer, tokenizer_id = self._tokenizer()
        key = spec.key(tokenizer_id)
        with self._lock:
            grammar = self._memory.get(key)
            if grammar is not None:
                self._memory.move_to_end(key)
                self.stats.memory_hits += 1
                return grammar
        started = time.perf_counter()
        entry = self._read(key)
        from_disk = entry is not None
        if entry is not None:
            text = entry[1]
            self.stats.disk_hits += 1
            self._touch(key)
        else:
            self.stats.misses += 1
            try:
                text = spec.library_grammar()
                validate(text, tokenizer)
            except GrammarError:
                self.stats.refused += 1
                raise
            except Exception as exc:
                self.stats.refused += 1
                raise GrammarError(str(exc)[:500]) from None
        template = llguidance.LLMatcher(tokenizer, text)
        if template.is_error():
            self.stats.refused += 1
            raise GrammarError(template.get_error()[:500])
        self.stats.compiles += 1
        self.stats.compile_seconds += time.perf_counter() - started
        if not from_disk:
            self._write(key, spec, text)
        grammar = Grammar(spec, template, self.matchers, len(self.tokenizer.hf))
        self._remember(key, grammar)
        return grammar

    def _remember(self, key: str, grammar: Grammar) -> None:
        with self._lock:
            self._memory[key] = grammar
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)

    # -- disk --------------------------------------------------------------------------

    def _path(self, key: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{key}.grammar"

    def _read(self, key: str, warn: bool = True) -> tuple[GrammarSpec, str] | None:
        """(spec, validated grammar) of a disk entry, or None (missing or damaged)."""
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            data = path.read_bytes()
            length, crc = check_header(MAGIC, int(key[:16], 16), data[:HEADER.size])
            payload = data[HEADER.size:HEADER.size + length]
            check_payload(payload, length, crc, len(data) > HEADER.size + length)
            entry = json.loads(payload)
            return GrammarSpec(entry["kind"], entry["source"]), entry["grammar"]
        except (BadBlob, OSError, ValueError, KeyError, TypeError) as exc:
            if warn:
                log.warning("ignoring grammar cache entry %s: %s", path, exc)
            return None

    def _write(self, key: str, spec: GrammarSpec, text: str) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = json.dumps({"kind": spec.kind, "source": spec.source,
                                  "grammar": text}).encode()
            write_atomic(path, [pack_header(MAGIC, int(key[:16], 16), payload), payload])
        except OSError as exc:
            log.warning("cannot write grammar cache entry %s: %s", path, exc)

    def _touch(self, key: str) -> None:
        """A disk entry used now is among the first a restart prewarms."""
        path = self._path(key)
        try:
            if path is not None:
                os.utime(path)
        except OSError:
            pass


def compiler_for(tokenizer: Any, config: Any) -> GrammarCompiler:
    """The compiler of a server or replica with this engine config: on disk in
    --grammar-cache-dir, else beside the weights cache, unless --no-grammar-cache."""
    cache_dir = None
    if not getattr(config, "no_grammar_cache", False):
        configured = getattr(config, "grammar_cache_dir", None)
        if configured:
            cache_dir = Path(configured).expanduser()
        else:
            from radixserve.model.weights_cache import default_cache_dir
            base = getattr(config, "weights_cache_dir", None)
            cache_dir = (Path(base).expanduser() if base else default_cache_dir()) / "grammars"
    compiler = GrammarCompiler(tokenizer, cache_dir,
                               timeout_s=getattr(config, "grammar_compile_timeout_s",
                                                 DEFAULT_TIMEOUT_S))
    prewarm = getattr(config, "grammar_prewarm", 0)
    if prewarm > 0:
        compiler.prewarm(prewarm)           # in the background: starting does not wait
    return compiler
