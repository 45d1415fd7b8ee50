"""`serve --replicas N` without Ray installed: one clear line naming the extra."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["ray"] = None          # as if ray were not installed
from radixserve.cli import main
sys.exit(main(["serve", "--replicas", "2"]))
"""


def test_replicas_without_ray_names_the_extra():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines == ["radixserve: --replicas needs Ray Serve: pip install 'radixserve[ray]'"]


def test_router_flag_is_checked_before_anything_loads():
    done = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--replicas", "2",
                           "--router", "nearest"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--router" in done.stderr


def test_load_bound_flag_is_parsed_and_checked():
    import argparse

    from radixserve.cluster.options import add_cluster_arguments, cluster_options
    from radixserve.routing import LoadBound

    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    args = parser.parse_args(["--replicas", "2", "--router-load-bound", "1.5+3"])
    assert cluster_options(args).load_bound == LoadBound(1.5, 3)
    assert cluster_options(parser.parse_args(["--replicas", "2"])).load_bound == LoadBound()
    done = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--replicas", "2",
                           "--router-load-bound", "0.5"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "invalid load bound value: '0.5'" in done.stderr
