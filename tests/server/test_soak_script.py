"""scripts/soak.py, shortened for CI (the issue's 2 minutes of load instead of 30): the
mixed load against a real server subprocess with a disk tier passes its own checks (no 5xx,
no leaked descriptor or thread, RSS flat after warm-up, pages conserved at every sample, a
tenant's own flush succeeding under load),
and the mix really ran: with ``every_kind`` the soak goes on past its 2 minutes until each
kind of action has answered (a busy machine runs fewer of them)."""

from __future__ import annotations

import argparse

import pytest

DURATION_S = 120


@pytest.mark.timeout(1800)      # a busy machine stretches the load until every kind answered
def test_a_short_soak_passes(load_script):
    soak = load_script("soak")
    args = argparse.Namespace(duration_s=DURATION_S, clients=4, sample_s=1.0,
                              rss_tolerance_mib=48.0, kv_cache_tokens=1024,
                              model="smollm2-135m-instruct", dtype="float32", seed=0,
                              every_kind=True)
    summary = soak.run(args)
    print(summary)
    assert summary["errors"] == [] and summary["ok"]
    kinds = {key.split(":")[0] for key in summary["statuses"]}
    assert set(soak.EVERY_KIND) <= kinds, summary["statuses"]
    assert not any(key.endswith(":None") or int(key.split(":")[1]) >= 500
                   for key in summary["statuses"] if not key.startswith("hostile"))
    assert summary["statuses"].get("tenant_flush:200", 0) >= 1, summary["statuses"]
    assert summary["samples"] >= 5
    assert summary["idle_fds_threads"]["after_warmup"] is not None
