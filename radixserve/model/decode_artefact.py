"""The compiled lone decode step on disk: its key, building it (AOTInductor), checking it.

Why AOTInductor (``torch._inductor.aoti_compile_and_package``): its shared library loads
in well under a second with no tracing, where ``torch.compile`` re-traces the 30 layers at
every start even with Inductor's caches warm. The cache keeps the package's ``.so`` alone,
loaded by torch's C++ runner (``AOTIModelContainerRunnerCpu``): loading the ``.pt2``
through ``aoti_load_package`` imported Inductor's Python side and unpacked the archive at
every start (10.6 s of a busy machine's start-up, against ~0.5 s for the ``.so``). It is
compiled from ``lone_step`` with the context length dynamic (a ``torch.export`` Dim up to
the model's context) and the pool size dynamic, so one artefact serves every request and
every ``--kv-cache-tokens``.

What the key covers: the compiled code depends on the architecture, the dtypes and the
weights' forms, not on the weight values: at load every weight the library names is
replaced by the model's own tensor (``update_constant_buffer``, user-managed: no copy, the
library's embedded weights are never read). So the key is the model config, the
activations' dtype, the weights' form, torch's version, the CPU's ISA and a fingerprint of
the code that defines the step. Each artefact has a sidecar JSON holding its key fields and
the library's sha256; a library whose sidecar is missing, unreadable, of another key or of
another hash is refused (and rebuilt), never loaded.

Run as ``python -m radixserve.model.decode_artefact SPEC.json``: the compile runs in a
child process (``compiled_decode.CompiledDecode``) so that the server serves eagerly
meanwhile and tracing never touches the serving process's torch state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.file_hash import file_sha256, modules_digest

from .orphan_guard import exit_with_parent

# Modules whose code decides what the compiled step computes: editing one retires artefacts.
_FINGERPRINTED = ("radixserve.model.lone_step", "radixserve.model.llama",
                  "radixserve.model.rope", "radixserve.model.quantized_linear",
                  "radixserve.model.packed_linear", "radixserve.model.dual_linear",
                  "radixserve.model.decode_artefact")


@dataclass(frozen=True)
class ArtefactKey:
    """What a compiled step must match to be loaded (see the module docstring)."""

    model_config: str         # repr of the ModelConfig: every shape and option
    dtype: str                # activations
    weights_dtype: str        # bf16 (the model's dtype), int8, int4, int4+float
    kv_dtype: str             # what the pool stores
    torch_version: str
    cpu_isa: str              # torch's CPU capability (AVX2, AVX512, ...) and a digest
                              # of the CPU's flags: Inductor builds with -march=native
    code: str                 # fingerprint of _FINGERPRINTED

    @classmethod
    def of(cls, model_config, dtype: torch.dtype, weights_dtype: str,
           kv_dtype: torch.dtype) -> ArtefactKey:
        return cls(model_config=repr(model_config), dtype=_name(dtype),
                   weights_dtype=weights_dtype, kv_dtype=_name(kv_dtype),
                   torch_version=torch.__version__,
                   cpu_isa=cpu_isa(), code=code_fingerprint())

    @property
    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_isa() -> str:
    """torch's CPU capability and a digest of /proc/cpuinfo's flags (where there is one)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        import platform
        flags = platform.processor()
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{torch.backends.cpu.get_cpu_capability()}-{digest}"


def code_fingerprint() -> str:
    return modules_digest(_FINGERPRINTED)


@dataclass(frozen=True)
class ArtefactPaths:
    """The package, its sidecar and its build log for one key in ``directory``."""

    directory: Path
    key: ArtefactKey

    @property
    def library(self) -> Path:
        return self.directory / f"lone-decode-{self.key.digest}.so"

    @property
    def sidecar(self) -> Path:
        return self.library.with_suffix(".json")

    @property
    def log(self) -> Path:
        return self.library.with_suffix(".log")

    @property
    def spec(self) -> Path:
        return self.library.with_suffix(".spec.json")

    def check(self) -> str | None:
        """Why the library on disk must not be loaded, or None when it may."""
        if not self.library.exists():
            return "no compiled step cached"
        try:
            side = json.loads(self.sidecar.read_text())
        except (OSError, ValueError) as e:
            return f"its sidecar is unreadable ({e})"
        if side.get("key") != dataclasses.asdict(self.key):
            return "it was built for another model, dtype, torch, CPU or code"
        if side.get("sha256") != file_sha256(self.library):
            return "its bytes do not match the sha256 recorded when it was built"
        return None

    def discard(self) -> None:
        for p in (self.library, self.sidecar):
            p.unlink(missing_ok=True)


def export_and_compile(step: torch.nn.Module, kv_pool, max_context: int,
                       paths: ArtefactPaths) -> None:
    """Export ``step`` (a LoneDecodeStep) with a dynamic context and pool size, compile it
    with AOTInductor, and publish its shared library and sidecar atomically."""
    import zipfile

    from torch.export import Dim, export

    from .lone_step import pool_views

    ks, vs = pool_views(kv_pool)
    example = (torch.tensor([1]), torch.tensor([2]), torch.arange(2), torch.tensor([3]), ks, vs)
    context, slots = Dim("context", min=1, max=max_context - 1), Dim("slots")
    layers = len(ks)
    with torch.no_grad():
        program = export(step, example, strict=False, dynamic_shapes=(
            None, None, {0: context}, None, [{0: slots}] * layers, [{0: slots}] * layers))
    paths.directory.mkdir(parents=True, exist_ok=True)
    stem = paths.directory / f"{paths.library.stem}.{os.getpid()}.tmp"
    package = torch._inductor.aoti_compile_and_package(program,
                                                       package_path=f"{stem}.pt2")
    with zipfile.ZipFile(package) as z:     # the one model's .so (kernels linked in)
        (member,) = [n for n in z.namelist() if n.endswith(".wrapper.so")]
        with z.open(member) as src, open(f"{stem}.so", "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.unlink(package)
    side = {"key": dataclasses.asdict(paths.key), "sha256": file_sha256(Path(f"{stem}.so"))}
    Path(f"{stem}.json").write_text(json.dumps(side, indent=1))
    os.replace(f"{stem}.so", paths.library)     # the library first: a sidecar alone is refused
    os.replace(f"{stem}.json", paths.sidecar)


@dataclass(frozen=True)
class BuildSpec:
    """What the child process needs to rebuild the served model and compile its step."""

    model: str
    dtype: str
    weights_dtype: str
    kv_dtype: str
    weights_cache_dir: str | None
    directory: str
    expected_digest: str        # the parent's key: the child refuses to write another


def build_in_this_process(spec: BuildSpec) -> None:
    from radixserve.attention.kv_pool import KVPool

    from .lone_step import LoneDecodeStep
    from .loader import load_model
    from .weights_cache import WeightsCache

    cache = WeightsCache.at(spec.weights_cache_dir) if spec.weights_cache_dir else None
    loaded = load_model(spec.model, dtype=spec.dtype, weights_cache=cache,
                        weights_dtype=spec.weights_dtype)
    cfg = loaded.config
    kv_dtype = getattr(torch, spec.kv_dtype)
    pool = KVPool(cfg.num_layers, 4, 1, cfg.num_kv_heads, cfg.head_dim, kv_dtype, "cpu")
    key = ArtefactKey.of(cfg, loaded.dtype, loaded.weights_dtype, kv_dtype)
    if key.digest != spec.expected_digest:
        raise SystemExit(f"the rebuilt model's key {key.digest} is not the server's "
                         f"{spec.expected_digest}: nothing written")
    export_and_compile(LoneDecodeStep(loaded.model).eval(), pool,
                       cfg.max_position_embeddings, ArtefactPaths(Path(spec.directory), key))


if __name__ == "__main__":
    exit_with_parent()          # a killed server leaves no compile behind
    build_in_this_process(BuildSpec(**json.loads(Path(sys.argv[1]).read_text())))
