"""The KV save's page writes: one fsynced file per page, written one at a time vs
SAVE_WRITERS at once (engine/kv_persistence.py: write_pages), side by side in one run on
the same disk, rounds alternating. Pages are SmolLM2-135M's fp32 size at page size 1
(46,080 bytes), the 50-tool agent loop's case (scripts/bench_structured.py --two-processes).

    PYTHONPATH=$PWD python scripts/bench_save_writes.py [--pages 600] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from radixserve.engine.kv_persistence import SAVE_WRITERS, write_pages
from radixserve.storage import DiskPageStore, TierPages, model_fingerprint

PAGE_BYTES = 46_080


def one_round(directory: str, pages: int, workers: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per page of writing `pages` pages into a fresh store."""
    with tempfile.TemporaryDirectory(dir=directory) as d:
        model = Path(d) / "model"           # an empty stand-in for the weights
        model.mkdir()
        fingerprint = model_fingerprint(model_path=model, dtype="float32", page_size=1,
                                        kv_k="float32", kv_v="float32", num_layers=30,
                                        num_kv_heads=3, head_dim=64)
        store = DiskPageStore(Path(d) / "kv", fingerprint, 16 << 30)
        payload = os.urandom(PAGE_BYTES)
        wall, cpu = time.perf_counter(), time.process_time()
        written = write_pages(TierPages(store), list(range(pages)), [payload] * pages, workers)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        store.close()
    assert written == pages, written
    return wall / pages * 1e3, cpu / pages * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk "
                    "to measure (the one --kv-disk-dir would use)")
    args = ap.parse_args()
    results: dict[int, list[tuple[float, float]]] = {1: [], SAVE_WRITERS: []}
    for _ in range(args.rounds):
        for workers in results:
            results[workers].append(one_round(args.dir, args.pages, workers))
    median = lambda xs: round(sorted(xs)[len(xs) // 2], 3)     # noqa: E731
    out = {f"{w}_at_once": {"wall_ms_per_page": median([r[0] for r in rs]),
                            "cpu_ms_per_page": median([r[1] for r in rs])}
           for w, rs in results.items()}
    one, many = out["1_at_once"], out[f"{SAVE_WRITERS}_at_once"]
    out["wall_ratio"] = round(one["wall_ms_per_page"] / many["wall_ms_per_page"], 2)
    print(json.dumps({"pages": args.pages, "rounds": args.rounds, **out}))


if __name__ == "__main__":
    main()
