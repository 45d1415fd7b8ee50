"""GrammarCompiler: grammars compiled off the event loop and the compute thread, under a time
cap, kept in a bounded in-memory LRU and on disk.

- Memory: the last `memory_entries` grammars (a template matcher each), by cache key.
- Disk: `<cache dir>/grammars/<key>.grammar`, the library's validated grammar in a checked
  blob (magic, length, CRC32C: the KV pages' framing, storage/checked_blob.py). The key
  (GrammarSpec.key) covers the schema, the tokenizer and the library version, so a restarted
  server skips the schema conversion and validation of every grammar it compiled before
  and only builds the matcher; a damaged file is ignored and rewritten.
- The cap: a compile that runs past `timeout_s` is a GrammarTimeout (a 400 upstream); its
  thread finishes on its own (Rust cannot be interrupted) but nobody waits for it, and the
  pool has threads of its own, so no other request or step is held up.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf

from radixserve.engine.grammar import (Grammar, GrammarError, GrammarSpec, MatcherCounter,
                                       validate)
from radixserve.storage.atomic_files import write_atomic
from radixserve.storage.checked_blob import HEADER, BadBlob, check_header, check_payload, pack_header

log = logging.getLogger(__name__)

MAGIC = b"RSGRAMR1"
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


class GrammarCompiler:
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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the library's view of the tokenizer (built once, ~0.4 s) ---------------------

    def _tokenizer(self) -> tuple[llguidance.LLTokenizer, str]:
        with self._lock:
            if self._ll_tokenizer is None:
                hf = self.tokenizer.hf
                eos_ids = sorted(self.tokenizer.eos_token_ids)
                eos = hf.eos_token_id if hf.eos_token_id is not None else (
                    eos_ids[0] if eos_ids else None)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf),
                                                                  eos_token=eos)
                vocab = hf.get_vocab()
                digest = hashlib.sha256()
                for token, i in sorted(vocab.items(), key=lambda kv: kv[1]):
                    digest.update(struct.pack("<I", i) + token.encode())
                digest.update(repr(eos).encode())
                self._tokenizer_id = digest.hexdigest()[:32]
            return self._ll_tokenizer, self._tokenizer_id

    # -- compiling ---------------------------------------------------------------------

    async def compile(self, spec: GrammarSpec) -> Grammar:
        """The grammar for `spec`, from memory, disk or a fresh compile on the grammar
        threads; GrammarError when refused, GrammarTimeout past the cap."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self.compile_blocking, spec)
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
        text = self._read(key)
        from_disk = text is not None
        if from_disk:
            self.stats.disk_hits += 1
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
            self._write(key, text)
        grammar = Grammar(spec, template, self.matchers, len(self.tokenizer.hf))
        with self._lock:
            self._memory[key] = grammar
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)
        return grammar

    # -- disk --------------------------------------------------------------------------

    def _path(self, key: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{key}.grammar"

    def _read(self, key: str) -> str | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            data = path.read_bytes()
            length, crc = check_header(MAGIC, int(key[:16], 16), data[:HEADER.size])
            payload = data[HEADER.size:HEADER.size + length]
            check_payload(payload, length, crc, len(data) > HEADER.size + length)
            return payload.decode()
        except (BadBlob, OSError, UnicodeDecodeError) as exc:
            log.warning("ignoring grammar cache entry %s: %s", path, exc)
            return None

    def _write(self, key: str, text: str) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = text.encode()
            write_atomic(path, [pack_header(MAGIC, int(key[:16], 16), payload), payload])
        except OSError as exc:
            log.warning("cannot write grammar cache entry %s: %s", path, exc)
