"""The scheduler, its null model and these tests need no torch (issue 11: they must run
without it, in milliseconds). Checked in a fresh interpreter where importing torch fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCRIPT = """
import sys
sys.modules["torch"] = None          # any `import torch` now raises ImportError
sys.path[:0] = [{root!r}, {here!r}]
import sched_harness, test_scheduler_policy, test_scheduler_properties
import radixserve.engine.core, radixserve.engine.null_model
bench = sched_harness.Bench(page_size=4, num_pages=24, token_budget=64)
for i in range(6):
    bench.submit(sched_harness.random_prompt(__import__("random").Random(i), 30), max_tokens=20)
bench.run()
assert bench.scheduler.stats.preemptions > 0
print("ok", sorted(m for m in sys.modules if m.startswith("radixserve.")))
"""


def test_scheduler_tests_run_without_torch():
    code = SCRIPT.format(root=str(HERE.parents[1]), here=str(HERE))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")
    assert "radixserve.engine.scheduler" in done.stdout
