"""The request body limit, `--max-body-bytes`: by default (`auto`) derived from what the
model can take, so that a body that can never fit the context is refused by its declared
length, never read or parsed (issue 39: a 5 MB prompt read and decoded on the event loop
held the GIL while other streams' steps waited).

`auto` = 1 MiB + 64 bytes per token of the context (2048 tokens: 1.125 MiB; 8192:
1.5 MiB; 131072: 9 MiB). Why these numbers (SmolLM2's tokenizer, measured with
`json.dumps`, ASCII-escaped and not):
- a prompt costs 1-7 bytes of JSON per token: English 4.5, code 3.8, digits 1.0, Chinese
  2.0 (4.0 with `\\uXXXX` escapes), emoji 1.3 (4.0 escaped), control characters 6.6;
  chat messages cost ~30 bytes of JSON for 4-5 template tokens, tools' JSON schemas are
  rendered into the prompt, so they are prompt tokens too. 64 per token is ten times the
  densest real text; only runs of whitespace come near it (a run of spaces: 63.7 bytes a
  token; the longest vocabulary entry, a newline and 80 spaces, 82 bytes);
- the 1 MiB is room for what is not prompt tokens (stop strings: at most 16 x 1024
  characters, 192 KiB even if every character is escaped; a response_format schema;
  ids and metadata), and it also covers whitespace-only prompts up to a 58,000-token
  context. Beyond that the flag takes an explicit size.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.units import parse_bytes

AUTO = "auto"
ROOM_BYTES = 1 << 20
BYTES_PER_TOKEN = 64


@dataclass(frozen=True)
class BodyLimit:
    """The limit in bytes and how it was set (said in every 413)."""

    bytes: int
    source: str

    @classmethod
    def resolve(cls, configured: int | None, max_model_len: int) -> "BodyLimit":
        """`configured` None: `auto` for a context of `max_model_len` tokens."""
        if configured is not None:
            return cls(configured, "set by --max-body-bytes")
        return cls(ROOM_BYTES + BYTES_PER_TOKEN * max_model_len,
                   f"--max-body-bytes auto: 1 MiB + {BYTES_PER_TOKEN} bytes per token of the "
                   f"{max_model_len}-token context; a size given to the flag replaces it")


def parse_max_body_bytes(text: str) -> int | None:
    """The flag's value: `auto` (None) or a byte size such as `8MiB`."""
    return None if text.strip().lower() == AUTO else parse_bytes(text)
