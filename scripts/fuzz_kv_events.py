"""The KV events consistency fuzz at full size: 100k random cache operations (and more
seeds), a router index built from the events predicting every request's match.

    PYTHONPATH=. python scripts/fuzz_kv_events.py [--ops 100000] [--seeds 1]

The suite runs the same fuzz (tests/events/test_consistency_fuzz.py) at 20k operations;
this runs the issue's 100k, split as there between page size 1 / 4-token blocks / array
encoding (60%) and page size 2 / 8-token blocks / map encoding (40%). Prints the operation
counts and the number of requests whose prediction was checked (all of them, or it fails).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.events.test_consistency_fuzz import CONFIGS, fuzz  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    for seed in range(args.seeds):
        for share, (ps, block, encoding, base_seed) in zip((0.6, 0.4), CONFIGS):
            n = int(args.ops * share)
            started = time.perf_counter()
            got = fuzz(n, ps, block, encoding, base_seed + 100 * seed)
            print(f"ops={n} page_size={ps} block={block} encoding={encoding} "
                  f"seed={base_seed + 100 * seed}: {got} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
            assert got["checked"] == got["request"]
    print("every prediction matched the engine's match")


if __name__ == "__main__":
    main()
