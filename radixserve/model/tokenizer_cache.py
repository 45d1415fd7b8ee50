"""A GGUF's converted tokenizer, kept on disk between starts.

transformers' GGUF converter rebuilds a SentencePiece vocabulary token by token: Gemma 3's
262k tokens took ~100 s at every start (2 busy cores), reading the saved result back ~10 s.
The first start saves the converted tokenizer (`save_pretrained`) under the cache
directory, keyed by the file's sha256 and transformers' version (a changed file or
converter never matches an old entry); later starts read it. Written into a temporary
directory and renamed, so a crash never leaves half an entry; an entry that fails to load
is removed and rebuilt, never half used.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from radixserve.file_hash import file_sha256

from .cache_dir import default_cache_dir

__all__ = ["cached_tokenizer"]

log = logging.getLogger(__name__)


def cached_tokenizer(path: Path, convert: Callable[[], Any],
                     cache_dir: Path | None = None) -> Any:
    """The tokenizer `convert()` builds for the GGUF at `path`, from the cache when an entry
    for this file and transformers version exists (else converted, then saved)."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    key = f"{file_sha256(path)[:32]}-transformers-{transformers.__version__}"
    entry = (cache_dir or default_cache_dir()) / "tokenizers" / key
    if entry.is_dir():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
        except Exception as e:      # a damaged entry: rebuilt below
            log.warning("tokenizer cache entry %s unreadable (%s): converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    hf = convert()
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        hf.save_pretrained(str(tmp))
        os.replace(tmp, entry)
    except OSError as e:            # read-only or full cache directory: serve regardless
        log.warning("tokenizer not cached at %s: %s", entry, e)
        shutil.rmtree(tmp, ignore_errors=True)
    return hf
