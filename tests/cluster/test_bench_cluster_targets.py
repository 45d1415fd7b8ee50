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


def test_equal_savings_pass_against_prefix_affinity_only_at_the_maximum_possible(load_script):
    # Ray's router sent everything to one replica and saved all there is (the one replica
    # holding the KV of four saves the same 800): equal is the most possible, at a lower
    # spread it passes; below the maximum, or at a higher spread, equal fails.
    def run(ca, ref):
        results = [result("single", "off", **{"few-shot": (200, 1.0)}),
                   result("cache-aware", "ray", **{"few-shot": ca}),
                   result("prefix-affinity", "off", **{"few-shot": ref})]
        lines = load_script("bench_cluster").targets(results)
        return [line.split()[0] for line in lines[1:]][-1], lines[-1]

    verdict, line = run((200, 1.25), (200, 4.0))
    assert verdict == "PASS" and "saved 800 = the maximum vs 800 (maximum possible 800)" in line
    assert run((200, 4.0), (200, 2.0))[0] == "FAIL"            # equal, at a higher spread
    assert run((250, 1.0), (250, 4.0))[0] == "FAIL"            # equal, below the maximum
