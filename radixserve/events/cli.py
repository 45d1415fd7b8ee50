"""`radixserve kv-events ENDPOINT`: print or record a KV event stream as JSON lines.

A debugging aid for `--kv-events` (or any vLLM publisher): subscribes, catches up through
the replay endpoint when one is given, and writes one JSON line per batch
(recording.py) to stdout or `--out`, until `--count` batches or `--timeout` seconds
without a batch. `radixserve replay --trace FILE` reads the recording as a trace.
"""

from __future__ import annotations

import argparse
import sys

from radixserve.events.recording import batch_record


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", help="the publisher's PUB endpoint, e.g. tcp://host:5557")
    parser.add_argument("--replay", default=None, metavar="ENDPOINT",
                        help="its replay endpoint: batches sent before we joined, and gaps")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to")
    parser.add_argument("--encoding", default="array", choices=["array", "map"])
    parser.add_argument("--out", default=None, help="write JSON lines here (default stdout)")
    parser.add_argument("--count", type=int, default=None, help="stop after this many batches")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop after this many seconds without a batch")


def run(args: argparse.Namespace) -> int:
    from radixserve.events.subscriber import EventSubscriber

    sub = EventSubscriber(args.endpoint, args.replay, args.topic, args.encoding)
    out = open(args.out, "wb") if args.out else sys.stdout.buffer
    seen = 0
    try:
        got = sub.catch_up() if args.replay else []
        while args.count is None or seen < args.count:
            for r in got:
                out.write(batch_record(r.seq, r.batch))
                seen += 1
                if args.count is not None and seen >= args.count:
                    break
            out.flush()
            if args.count is not None and seen >= args.count:
                break
            wait_ms = -1 if args.timeout is None else int(args.timeout * 1000)
            got = sub.receive(wait_ms)
            if not got and args.timeout is not None:
                break
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        if args.out:
            out.close()
    if sub.lost:
        print(f"kv-events: {sub.lost} batches could not be replayed: the recording has "
              f"gaps", file=sys.stderr)
    return 0
