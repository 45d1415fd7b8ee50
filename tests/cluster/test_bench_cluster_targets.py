"""bench_cluster.py --full checks issue 38's Show list on its results (`targets`): each
target's line says PASS only when its figures meet it, FAIL otherwise."""

from __future__ import annotations


def result(router, share, **workloads):
    config = "1 replica, 4x KV" if router == "single" else f"4 x {router} {share}"
    return {"config": config, "router": router, "share": share,
            "workloads": {w: {"prompt_tokens": 1000, "computed_tokens": c,
                              "token_hit_rate": 1 - c / 1000, "requests_max_over_mean": s}
                          for w, (c, s) in workloads.items()}}


def verdicts(load_script, results) -> list[str]:
    """PASS or FAIL per target line, in the order `targets` checks them."""
    return [line.split()[0] for line in load_script("bench_cluster").targets(results)[1:]]


def test_every_target_passes_on_figures_that_meet_it_and_fails_on_those_that_miss(
        load_script):
    single = result("single", "off", **{"few-shot": (200, 1.0)})
    good = [single,
            result("cache-aware", "off", **{"few-shot": (500, 2.0),
                                            "shared-prefix": (400, 1.0)}),
            result("cache-aware", "dir:/tmp/x", **{"few-shot": (201, 1.25),
                                                   "shared-prefix": (400, 1.0)}),
            result("prefix-affinity", "off", **{"few-shot": (450, 1.5),
                                                "shared-prefix": (420, 1.0)})]
    assert verdicts(load_script, good) == ["PASS"] * 6
    bad = [single, good[1],
           result("cache-aware", "dir:/tmp/x", **{"few-shot": (260, 1.5),
                                                  "shared-prefix": (430, 1.0)}),
           result("prefix-affinity", "off", **{"few-shot": (450, 1.5),
                                               "shared-prefix": (420, 1.0)})]
    # few-shot: computed, hit rate, spread; shared-prefix: computed; against
    # prefix-affinity: few-shot (more saved, equal spread), shared-prefix (less saved).
    assert verdicts(load_script, bad) == ["FAIL", "FAIL", "FAIL", "FAIL", "PASS", "FAIL"]
