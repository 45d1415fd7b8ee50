"""Text traces (prompt / messages / input_ids) through a tokenizer into the cache."""

from __future__ import annotations

import pytest

from radixserve.replay.replayer import ReplayConfig, replay
from radixserve.replay.tokens import TextTokenizer
from radixserve.replay.traces import read_trace
from radixserve.replay.workload import Workload

from .helpers import write_jsonl


class CharTokenizer:
    """One token per character; a chat template that writes 'role: content\\n' lines."""

    def encode(self, text):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))


def char_tokenizer() -> TextTokenizer:
    tok = TextTokenizer("chars")
    tok._tok = CharTokenizer()        # the loader is never called
    return tok


SYSTEM = {"role": "system", "content": "Answer in one word."}
RECORDS = [
    {"messages": [SYSTEM, {"role": "user", "content": "Capital of France?"}],
     "output": "Paris"},
    {"messages": [SYSTEM, {"role": "user", "content": "Capital of Spain?"}]},
    {"prompt": "abcdefgh"},
    {"prompt": "abcdefgh"},
    {"input_ids": [97, 98, 99, 100, 1, 2]},
]


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("mode", ["token", "block"])
def test_hits_are_the_shared_character_prefixes(tmp_path, mode):
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", RECORDS))
    work = Workload(trace, mode, 1, tokenizer=char_tokenizer())
    s = replay(work, ReplayConfig(None, check_every=1))
    chat1 = "system: Answer in one word.\nuser: Capital of France?\nassistant: "
    chat2 = "system: Answer in one word.\nuser: Capital of Spain?\nassistant: "
    want = [0, _common(chat1, chat2), 0, 7, 4]   # the repeat: L-1; input_ids share "abcd"
    assert s.hit_tokens == sum(want)
    assert s.hit_requests == 3
    assert s.query_tokens == len(chat1) + len(chat2) + 8 + 8 + 6


def test_block_mode_pages_of_text(tmp_path):
    # Page size 4: token mode copies a partial last page that a longer cached page starts
    # with; block mode names text pages by their whole content, so it cannot, and may only
    # count fewer hits (docs/replay.md). Whole pages agree.
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", RECORDS))
    tok = char_tokenizer()
    token = replay(Workload(trace, "token", 4, tokenizer=tok), ReplayConfig(None))
    block = replay(Workload(trace, "block", 4, tokenizer=tok), ReplayConfig(None))
    assert block.hit_tokens <= token.hit_tokens
    # "abcdefgh" twice: 8 tokens = 2 pages, 7 matchable: page 1 whole + 3 tokens of page 2
    # (copy-on-write of a whole cached page, so block mode finds it too).
    one = read_trace(write_jsonl(tmp_path / "one.jsonl", RECORDS[2:4]))
    for mode in ("token", "block"):
        s = replay(Workload(one, mode, 4, tokenizer=tok), ReplayConfig(None))
        assert s.hit_tokens == 7


def test_recorded_output_counts_with_include_outputs(tmp_path):
    # Turn 2 repeats turn 1's prompt and its recorded output: cached only with outputs.
    first = "user: hi\nassistant: "
    records = [{"prompt": first, "output": "hello there"},
               {"prompt": first + "hello there\nuser: more"}]
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    tok = char_tokenizer()
    for mode in ("token", "block"):
        plain = replay(Workload(trace, mode, 1, False, tok), ReplayConfig(None))
        outs = replay(Workload(trace, mode, 1, True, tok), ReplayConfig(None))
        assert plain.hit_tokens == len(first)
        assert outs.hit_tokens == len(first) + len("hello there")


def test_belady_on_text_needs_block_mode(tmp_path):
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", RECORDS))
    work = Workload(trace, "token", 1, tokenizer=char_tokenizer())
    with pytest.raises(ValueError, match="--mode block"):
        replay(work, ReplayConfig(100, "belady"))
