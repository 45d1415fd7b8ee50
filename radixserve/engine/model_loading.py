"""load_engine_model: the model an EngineConfig names, loaded as `serve`, `chat` and `batch`
all load it: on the compute thread, through the weights cache its flags choose."""

from __future__ import annotations

from radixserve.engine.compute_thread import on_compute_thread
from radixserve.engine.config import EngineConfig
from radixserve.phase_timer import PhaseTimer


def load_engine_model(config: EngineConfig, timer: PhaseTimer | None = None):
    """-> LoadedModel. `--no-weights-cache` dequantizes a GGUF every time; otherwise its
    parameters are kept in `--weights-cache-dir` (default: see WeightsCache.at)."""
    from radixserve.model import load_model
    from radixserve.model.weights_cache import WeightsCache

    cache = None if config.no_weights_cache else WeightsCache.at(config.weights_cache_dir)
    return on_compute_thread(load_model, config.model, dtype=config.dtype,
                             device=config.device, weights_cache=cache, timer=timer,
                             weights_dtype=config.weights_dtype)
