"""The token ids of a conversation's next turn: the previous turn's exact ids (prompt plus
generated reply, as the engine ran them) followed by the ids the chat template adds for the
new messages. Nothing before the new turn is re-rendered, so the whole history is a prefix
the radix tree holds, however the template would have rewritten it.

What the template adds is found by rendering, through the chat pipeline every route uses,
the history with a marker as the assistant's reply, with and without the new messages:

    closing  = the ids after the marker in render(history + [assistant: MARK])
               (e.g. `<|im_end|>` `\\n`; found as the common tail of two different markers)
    new_turn = render(history + [assistant: MARK] + new, generation prompt)
               minus render(history + [assistant: MARK]), when the latter is its prefix

and the next prompt is `previous ids + closing + new_turn`, less a leading closing token the
reply already generated (its end-of-turn token). A template whose rendering of the history
changes when messages are added (it is not a prefix) gives None: the caller re-renders the
whole conversation, a cache miss it reports.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

MARK_A = "\ue000radixserve-reply-a"
MARK_B = "\ue000radixserve-reply-b"

Render = Callable[[list[dict], bool], Awaitable[list[int]]]


def common_tail(a: list[int], b: list[int]) -> int:
    """Length of the longest common suffix of `a` and `b`."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


async def next_turn_ids(render: Render, history: list[dict], previous_ids: list[int],
                        new_messages: list[dict]) -> list[int] | None:
    """`previous_ids` extended by the new messages' turn, or None (see the module doc).
    `render(messages, add_generation_prompt)` is the chat template, off the event loop."""
    with_a = history + [{"role": "assistant", "content": MARK_A}]
    with_b = history + [{"role": "assistant", "content": MARK_B}]
    hist_a = await render(with_a, False)
    hist_b = await render(with_b, False)
    full = await render(with_a + new_messages, True)
    if full[:len(hist_a)] != hist_a:
        return None
    closing = hist_a[len(hist_a) - common_tail(hist_a, hist_b):]
    if closing and previous_ids and previous_ids[-1] == closing[0]:
        closing = closing[1:]               # the reply ended with the end-of-turn token
    return list(previous_ids) + closing + full[len(hist_a):]
