#!/usr/bin/env python3
"""Prefix hit-rate replay of a request trace: the same as `radixserve replay`.

    python scripts/replay.py ../shared/traces/mooncake_fast25_synthetic_trace.jsonl \
        --capacity-tokens 1M,4M,16M --policy lru,lfu --plot curve.png
    python scripts/replay.py TRACE --capacity-tokens 1M --replicas 1,4,16 --router all
    python scripts/replay.py TRACE --capacity-tokens 1M --host-capacity-tokens 4M
"""

import sys

from radixserve.replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
