"""--decode-compile: the lone decode (one stream, one new token) through a compiled step.

Why: eager torch cannot reach llama.cpp's per-token cost at batch 1 (the leanest eager
step measured 26.9 ms CPU per token against llama.cpp's 20.0, docs/benchmarks.md); the
same step compiled by Inductor can. Start-up must stay under 5 s, and a cold compile takes
minutes, so:

- at start the artefact cached for this key (``decode_artefact``) is checked and loaded
  (milliseconds); if there is none, a child process compiles it (``nice``d) while the
  server serves eagerly;
- ``poll()`` (called by the runner before each step) notices the child's end and loads
  what it wrote, or logs why there is nothing (no C++ compiler, a failed compile), after
  which the eager step simply stays;
- a loaded step is checked once against the eager ``LoneDecodeStep`` on a small context
  before it is used (every output within ``rtol`` of its magnitude): a library that
  computes something else is refused.

Only the plain Llama family on CPU with an unquantized KV pool qualifies
(``lone_step.unsupported_reason``); deterministic mode keeps the eager path (its
row-invariant linears are a different module tree).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .decode_artefact import ArtefactKey, ArtefactPaths, BuildSpec
from .errors import ModelLoadError
from .lone_step import LoneDecodeStep, pool_views, scratch_pools, unsupported_reason

log = logging.getLogger(__name__)

MODES = ("off", "on", "auto")
# The load-time check: each output's largest difference from the eager step's, relative to
# that output's largest magnitude. Fused loops sum in another order: in float32 throughout
# that moves the last bits (~1e-6 measured); where linears round their input to bf16 (int4,
# int8 or bf16 weights), a 1-ulp difference before the cast flips a bf16 rounding (2^-8 =
# 0.4% of one input) and carries through the layers (SmolLM2 int4: 0.125 absolute).
SELF_CHECK_RTOL_FP32 = 1e-4
SELF_CHECK_RTOL_BF16 = 3e-2
# bf16 (or fp16) activations, where the CPU has native bf16 (AMD EPYC): eager rounds every
# op's output to bf16, Inductor's fused loops keep their intermediates in fp32, and the
# difference grows over the layers: SmolLM2 int4, 30 layers, measured 0.07 (logits) to
# 0.12 (a deep layer's new K) between the two steps, while a wrong step (another token,
# position or context) differed by 0.55 to 1.9 on the same check.
SELF_CHECK_RTOL_HALF_ACTIVATIONS = 0.25


class DecodeCompileError(ModelLoadError):
    """``--decode-compile on`` for a model or mode the compiled step cannot serve (a
    ModelLoadError: ``serve`` prints it and exits 1)."""


def find_cxx() -> str | None:
    """The C++ compiler Inductor would call, or None when there is none."""
    from torch._inductor import config
    cxx = config.cpp.cxx[0] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    return shutil.which(cxx or "g++") or shutil.which("g++") or shutil.which("clang++")


@dataclass
class DecodeCompileStats:
    """What /metrics and the start-up line report."""

    state: str = "off"          # off | compiling | ready | eager (with `reason`)
    reason: str = ""
    compiles_started: int = 0   # child processes launched (a cached artefact: none)
    loads: int = 0
    compiled_steps: int = 0
    ready_after_s: float | None = None   # from start() to the step being usable


@dataclass
class CompiledDecode:
    """The compiled lone step for one model and pool; ``run`` once ``ready``."""

    step: LoneDecodeStep
    kv_pool: object
    paths: ArtefactPaths
    spec: BuildSpec
    rtol: float = SELF_CHECK_RTOL_BF16
    stats: DecodeCompileStats = field(default_factory=DecodeCompileStats)
    _runner: object | None = None
    _child: subprocess.Popen | None = None
    _started_at: float = 0.0

    @classmethod
    def create(cls, mode: str, loaded, kv_pool, directory: Path, *, deterministic: bool,
               weights_cache_dir: str | None) -> CompiledDecode | None:
        """None when ``mode`` is off or the model does not qualify (logged; ``on``
        raises DecodeCompileError instead)."""
        if mode not in MODES:
            raise DecodeCompileError(f"--decode-compile: {mode!r} is not one of {MODES}")
        if mode == "off":
            return None
        reason = ("deterministic mode keeps the eager step" if deterministic
                  else unsupported_reason(loaded.model, kv_pool))
        if reason is not None:
            if mode == "on":
                raise DecodeCompileError(f"--decode-compile on: {reason}")
            log.info("decode compile: eager (%s)", reason)
            return None
        kv_dtype = kv_pool.k_flat[kv_pool.layers[0]].dtype
        key = ArtefactKey.of(loaded.config, loaded.dtype, loaded.weights_dtype, kv_dtype)
        paths = ArtefactPaths(Path(directory), key)
        spec = BuildSpec(model=loaded.name, dtype=str(loaded.dtype).removeprefix("torch."),
                         weights_dtype=loaded.weights_dtype,
                         kv_dtype=str(kv_dtype).removeprefix("torch."),
                         weights_cache_dir=weights_cache_dir, directory=str(directory),
                         expected_digest=key.digest)
        return cls(LoneDecodeStep(loaded.model).eval(), kv_pool, paths, spec,
                   rtol=self_check_rtol(loaded.dtype, loaded.weights_dtype))

    def describe(self) -> str:
        """The start-up line."""
        s = self.stats
        if s.state == "ready":
            return (f"decode compile: the lone decode runs compiled ({self.paths.library}, "
                    f"loaded in {s.ready_after_s:.2f} s)")
        if s.state == "compiling":
            return (f"decode compile: compiling the lone decode step in the background "
                    f"(log {self.paths.log}); eager until it is ready")
        return f"decode compile: eager ({s.reason})"

    @property
    def ready(self) -> bool:
        return self._runner is not None

    def start(self) -> None:
        """Load the cached step, or start compiling it in a child process."""
        self._started_at = time.perf_counter()
        why = self.paths.check()
        if why is None and self._load():
            return
        if why is not None and self.paths.library.exists():
            log.warning("decode compile: cached step %s refused: %s; compiling again",
                        self.paths.library, why)
            self.paths.discard()
        self._spawn()

    def poll(self) -> None:
        """If the compile has finished: load its artefact, or fall back with the reason."""
        child = self._child
        if child is None or child.poll() is None:
            return
        self._child = None
        child.stdin.close()
        self.paths.spec.unlink(missing_ok=True)
        if child.returncode != 0:
            self._eager(f"the compile failed (exit {child.returncode}): {self._log_tail()}")
            return
        why = self.paths.check()
        if why is not None:
            self._eager(f"the compiled step was refused: {why}")
            return
        self._load()

    def wait_for_compile(self) -> None:
        """Block until a running compile ends, then take its result (scripts and tests: a
        server never waits, it polls)."""
        if self._child is not None:
            self._child.wait()
            self.poll()

    @property
    def compiling_pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def close(self) -> None:
        """Stop a compile still running (shutdown): the next start compiles again."""
        child, self._child = self._child, None
        if child is not None:
            if child.poll() is None:
                child.terminate()
                child.wait()
            child.stdin.close()

    def _spawn(self) -> None:
        if find_cxx() is None:
            self._eager("no C++ compiler found (Inductor needs g++ or clang++)")
            return
        d = self.paths.directory
        d.mkdir(parents=True, exist_ok=True)
        self.paths.spec.write_text(json.dumps(dataclasses.asdict(self.spec)))
        with open(self.paths.log, "wb") as out:
            # stdin: a pipe this process never writes; the child exits when it closes,
            # so a killed server leaves no compile running (orphan_guard.py).
            self._child = subprocess.Popen(
                [sys.executable, "-m", "radixserve.model.decode_artefact", str(self.paths.spec)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.nice(10), env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.stats.state, self.stats.compiles_started = "compiling", \
            self.stats.compiles_started + 1
        log.info("decode compile: compiling the lone decode step in the background "
                 "(pid %d, log %s); serving eagerly meanwhile", self._child.pid,
                 self.paths.log)

    def _load(self) -> bool:
        try:
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(self.paths.library), 1)
            tensors = _module_tensors(self.step)
            # The model's own tensors replace the library's embedded copies (never read).
            runner.update_constant_buffer(
                {name: tensors[fqn] for name, fqn in
                 runner.get_constant_names_to_original_fqns().items() if fqn in tensors},
                False, False, True)     # active buffer, partial update, user-managed
            err = self._self_check(runner)
        except Exception as e:          # a package torch cannot load is refused, not fatal
            err = f"{type(e).__name__}: {e}"
        if err is not None:
            log.warning("decode compile: cached step %s refused: %s", self.paths.library, err)
            self.paths.discard()
            self._eager(f"the compiled step was refused: {err}")
            return False
        self._runner = runner
        s = self.stats
        s.state, s.reason, s.loads = "ready", "", s.loads + 1
        s.ready_after_s = time.perf_counter() - self._started_at
        log.info("decode compile: the lone decode now runs compiled (%s, ready %.2f s "
                 "after start)", self.paths.library.name, s.ready_after_s)
        return True

    @torch.inference_mode()
    def _self_check(self, runner) -> str | None:
        """Compare the library with the eager step on scratch pools of the live pool's
        dtype (a compile can finish while the live pool holds requests' K/V, and the step
        writes into the pools it is given): the logits and the K/V each one wrote."""
        ks, vs = scratch_pools(self.kv_pool, slots=4)
        ks2, vs2 = [t.clone() for t in ks], [t.clone() for t in vs]
        args = (torch.tensor([1]), torch.tensor([2]), torch.arange(2), torch.tensor([3]))
        got = [*runner.run([*args, *ks, *vs]), *ks, *vs]
        ref = [self.step(*args, ks2, vs2), *ks2, *vs2]
        worst = max(float((g.float() - r.float()).abs().max() / r.float().abs().max()
                          .clamp_min(1e-6)) for g, r in zip(got, ref))
        return None if worst <= self.rtol else (
            f"its outputs differ from the eager step's by {worst:.3g} of their largest "
            f"magnitude (at most {self.rtol:g})")

    def _eager(self, reason: str) -> None:
        self.stats.state, self.stats.reason = "eager", reason
        log.warning("decode compile: eager step stays: %s", reason)

    def _log_tail(self) -> str:
        try:
            lines = self.paths.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1][:300] if lines else "empty log"

    @torch.inference_mode()
    def run(self, token: torch.Tensor, position: torch.Tensor, cached_slots: torch.Tensor,
            new_slot: torch.Tensor) -> torch.Tensor:
        """One lone decode: float32 logits [1, vocab]; the library writes the new K/V at
        ``new_slot`` of every layer of the pool."""
        ks, vs = pool_views(self.kv_pool)
        (logits,) = self._runner.run([token, position, cached_slots, new_slot, *ks, *vs])
        self.stats.compiled_steps += 1
        return logits


def self_check_rtol(dtype: torch.dtype, weights_dtype: str) -> float:
    """The load-time check's tolerance for a model's activations and weights."""
    if dtype != torch.float32:
        return SELF_CHECK_RTOL_HALF_ACTIVATIONS
    return SELF_CHECK_RTOL_FP32 if weights_dtype == "bf16" else SELF_CHECK_RTOL_BF16


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its qualified name (what the library's
    constants are named after)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}
