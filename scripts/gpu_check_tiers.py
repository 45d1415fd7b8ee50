"""The `tiers` section of scripts/gpu_check.py: KV pages demoted to pinned host memory and
to disk bytes, and loaded back into the pool, on the device.

On CUDA the tier mover copies pool <-> host memory on a side stream with events
(radixserve/attention/copy_stream.py). Checked: every page loaded back equals, byte for
byte, what was demoted (fp32, bf16 and fp8_e4m3 KV with their scales; page sizes 1 and
16), after the pool pages it came from were overwritten; the side stream was used (orders
were pending on it) and every event completed. On the CPU dry run the synchronous path
runs instead (no side stream).
"""

from __future__ import annotations

CASES = [("bfloat16", "bfloat16", 16), ("bfloat16", "fp8_e4m3", 16), ("float32", "float32", 1)]


class _Disk:
    """The disk writer's queue, written at once (bytes kept in memory)."""

    def __init__(self):
        self.pages: dict[int, bytes] = {}

    def submit(self, key: int, payload: bytes) -> None:
        self.pages[key] = bytes(payload)


def _case(dtype: str, kv: str, page_size: int, device: str) -> dict:
    import numpy as np
    import torch

    from radixserve.attention.kv_pool import KVPool
    from radixserve.attention.kv_tiers import HostKVPool, TierMover
    from radixserve.attention.page_bytes import pool_tensors
    from radixserve.cache.tiers import DISK, HOST, POOL, DemoteOrder, LoadOrder
    from radixserve.kv_sizing import KVFormat

    pool = KVPool(4, 32, page_size, 2, 64, getattr(torch, dtype), device,
                  kv_format=KVFormat(kv, kv))
    g = torch.Generator(device="cpu").manual_seed(0)
    for t in pool_tensors(pool):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                generator=g, dtype=torch.uint8))
    ids = lambda xs: np.asarray(xs, dtype=np.int32)  # noqa: E731
    src = [3, 7, 8, 20]
    before = [t[src].clone() for t in pool_tensors(pool)]
    disk = _Disk()
    mover = TierMover(pool, HostKVPool(pool, 8), disk)
    mover.run([DemoteOrder(POOL, ids(src), HOST, ids([5, 0, 2, 7]))])
    pending_after_demote = mover.events.pending
    for t in pool_tensors(pool):                 # the freed pool pages are reused
        t.view(torch.uint8)[src].fill_(0)
    mover.run([LoadOrder(HOST, ids([5, 0]), ids([10, 11])),
               DemoteOrder(HOST, ids([2, 7]), DISK, ids([1, 2]))])
    mover.run([LoadOrder(DISK, ids([1, 2]), ids([12, 13]), (disk.pages[1], disk.pages[2]))])
    mover.wait_copies()
    if device == "cuda":
        torch.cuda.synchronize()
    equal = all(torch.equal(b.view(torch.uint8), t[[10, 11, 12, 13]].view(torch.uint8))
                for b, t in zip(before, pool_tensors(pool)))
    return {"dtype": dtype, "kv": kv, "page_size": page_size, "bytes_equal": equal,
            "side_stream": mover.streams is not None,
            "pending_after_demote": pending_after_demote,
            "pinned_host": bool(mover.host.tensors[0].is_pinned()) if device == "cuda"
            else False,
            "pending_at_end": mover.events.pending}


def check_tiers(report: dict, device: str) -> None:
    section: dict = {"status": "running", "results": []}
    report["tiers"] = section
    for dtype, kv, ps in CASES:
        section["results"].append(_case(dtype, kv, ps, device))
    problems = [r for r in section["results"]
                if not r["bytes_equal"] or r["pending_at_end"]
                or (device == "cuda" and not (r["side_stream"] and r["pinned_host"]))]
    section["problems"] = problems
    section["status"] = "ok" if not problems else "fail"
