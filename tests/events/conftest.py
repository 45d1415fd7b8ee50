"""Shared pieces of the KV events tests: a publisher and a subscriber on free local ports."""

from __future__ import annotations

import pytest

from radixserve.events.publisher import EventPublisher
from radixserve.events.subscriber import EventSubscriber

LOCAL = "tcp://127.0.0.1:*"     # bind a free port


def drain(sub: EventSubscriber, pub: EventPublisher, sent: int) -> list:
    """Every batch up to the `sent`-th, in order: wait for the publisher's thread to send
    them, then take them through the replay (a subscriber's catch-up: PUB drops what was
    sent before its subscription arrived)."""
    assert pub.wait_sent(sent, timeout_s=30), "publisher thread did not send in time"
    got = sub.receive(0) + sub.catch_up()
    assert sub.next_seq == pub.first_seq + sent, (sub.next_seq, pub.first_seq, sent)
    return got


@pytest.fixture
def publisher():
    pub = EventPublisher(LOCAL, LOCAL)
    yield pub
    pub.close()
