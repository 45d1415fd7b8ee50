"""EngineConfig: every knob of the engine, and the command-line flags that set them.

Flag names follow SGLang / vLLM so their users need no translation table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from radixserve.cache.eviction import POLICIES
from radixserve.kv_sizing import DEFAULT_WINDOW_POOL_FRACTION, KV_DTYPE_CHOICES
from radixserve.share.store import share_arg
from radixserve.units import parse_bytes, parse_tokens

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_KV_DISK_BYTES = 16 * 2**30
DEFAULT_GRAMMAR_PREWARM = 32      # `serve --grammar-prewarm`: grammars rebuilt at start


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"                  # auto | bfloat16 | float16 | float32
    device: str = "auto"                 # auto | cpu | cuda
    attention_backend: str = "auto"      # auto | torch | flashinfer
    page_size: int = 1
    kv_cache_tokens: int | None = None   # pool size in tokens; None: from memory
    kv_cache_memory_fraction: float = 0.85  # CUDA: share of free GPU memory for the pool
    kv_cache_dtype: str = "auto"         # auto | bfloat16 | float16 | float32 | fp8_e4m3 | ...
    kv_cache_dtype_k: str | None = None  # keys apart (None: --kv-cache-dtype)
    kv_cache_dtype_v: str | None = None  # values apart
    max_running_requests: int = 256
    chunked_prefill_size: int = 2048     # token budget per step
    schedule_policy: str = "lpm"         # lpm | fcfs
    disable_radix_cache: bool = False
    eviction_policy: str = "lru"         # lru | lfu | gdsf | adaptive
    max_model_len: int | None = None     # None: the model's context length
    max_queue_len: int = 4096            # waiting requests beyond this are refused
    seed: int = 0
    debug_invariants: bool = False       # check page conservation whenever idle
    max_pinned_tokens: int | None = None  # POST /cache/pin budget; None: a quarter of the
                                          # pool; 0: pinning off (engine/pins.py)
    # Start-up prefill; None: chunked_prefill_size; 0: off. Small by default: it proves the
    # forward pass runs before /health says ready (~0.05 s); a full-size one cost ~1.8 CPU-s
    # and saved under 0.1 s on the first request (docs/benchmarks.md, "Startup").
    warmup_tokens: int | None = 32
    # Tiers below the KV pool (docs/tiers.md): host memory (L2) and a disk directory (L3).
    kv_host_tokens: int | None = None    # host tier size in tokens (None/0: no host tier)
    kv_host_bytes: int | None = None     #   or in bytes
    weights_cache_dir: str | None = None  # dequantized GGUF weights; None: default directory
    no_weights_cache: bool = False       # dequantize at every start instead
    kv_disk_dir: str | None = None       # KV pages kept on disk, across restarts (L3)
    kv_disk_bytes: int | None = None     # at most this much there, disk tier and saved
                                         #   cache together; None: DEFAULT_KV_DISK_BYTES
    # A request's tokens depend only on the request (not on its batch, chunking, the cache,
    # preemption or page size): row-invariant linears, fixed-split attention, no cascade
    # (docs/deterministic.md).
    deterministic: bool = False
    # Linear layers' weights: auto (the GGUF's precision class: Q8_0 -> int8, 4/5-bit and
    # K-quants -> int4; else bf16) | bf16 (the model's dtype) | int8 | int4 (CPU only;
    # model/weights_dtype.py)
    weights_dtype: str = "auto"
    # Constrained decoding (docs/structured.md): compiled grammars kept on disk between
    # starts, and the cap on one compile (a schema past it gets a 400).
    grammar_cache_dir: str | None = None    # None: <cache dir>/grammars
    no_grammar_cache: bool = False          # keep compiled grammars in memory only
    grammar_compile_timeout_s: float = 10.0
    # matchers rebuilt at start from the most recently used disk entries (0: none; the
    # `serve` flag's default is DEFAULT_GRAMMAR_PREWARM, tests and embedders opt in)
    grammar_prewarm: int = 0
    lpm_max_wait_steps: int = 16         # lpm: waiting this many steps puts a request first
    # KV cache events on vLLM's ZeroMQ contract, for external routers (llm-d, Dynamo):
    # radixserve/events, docs/scale-out.md. None: no events.
    kv_events: str | None = None          # PUB endpoint, e.g. tcp://*:5557
    kv_events_replay: str | None = None   # ROUTER endpoint for replays, e.g. tcp://*:5558
    kv_events_topic: str = ""
    kv_events_block_size: int = 16        # tokens per announced block (a page-size multiple)
    kv_events_encoding: str = "array"     # array (vLLM's array_like structs) | map
    kv_events_publisher: str = "process"  # process (its own, off the GIL) | thread
    kv_events_interval_ms: float = 10.0   # a busy engine hands over its steps' facts this often
    # Hybrid models (docs/models.md, "Window-aware cache"): the sliding-window layers in
    # their own pool holding only the windows a request or a match point needs.
    kv_window_pool: str = "auto"         # auto (on for one window size) | off (full KV)
    kv_window_pool_fraction: float = DEFAULT_WINDOW_POOL_FRACTION  # windowed per full page
    kv_window_checkpoint: int | None = None  # tokens between kept windows; None: 16 windows
    # The disk tier's journal (storage/journal.py): fsynced in batches this often; 0: at
    # every record. A kill -9 loses nothing either way; a power loss at most this much.
    kv_disk_journal_sync_ms: int = 1000
    # The cluster store (docs/scale-out.md, "Sharing KV between replicas"): off | ray |
    # dir:PATH, and its bound in bytes (None: DEFAULT_KV_SHARE_BYTES).
    kv_share: str = "off"
    kv_share_bytes: int | None = None
    # A store lookup's deadline is as long as computing the pages would take (measured),
    # and at least this: a lookup unanswered by then is a miss (engine/peer_share.py).
    kv_share_lookup_min_s: float = 1.0
    # --kv-share ray: a directory actor call or a page's object get slower than this is a
    # miss (share/ray_store.py); tests on a busy machine set it long.
    kv_share_call_timeout_s: float = 5.0
    # The lone decode (one stream) through an ahead-of-time compiled step, cached in the
    # weights cache dir (model/compiled_decode.py): off | on | auto.
    decode_compile: str = "off"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=d.model,
                   help="short name, Hugging Face model directory, or .gguf file")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "torch", "flashinfer"])
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--kv-cache-tokens", type=parse_tokens, default=None,
                   help="KV pool size in tokens (default: from available memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=d.kv_cache_memory_fraction)
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_DTYPE_CHOICES,
                   help="how K and V are stored (auto: the model's dtype); fp8/int8 keep a "
                        "scale per token and KV head")
    g.add_argument("--kv-cache-dtype-k", default=None, choices=KV_DTYPE_CHOICES,
                   help="keys only (e.g. bfloat16 with --kv-cache-dtype-v fp8_e4m3)")
    g.add_argument("--kv-cache-dtype-v", default=None, choices=KV_DTYPE_CHOICES,
                   help="values only")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    g.add_argument("--schedule-policy", default=d.schedule_policy, choices=["lpm", "fcfs"])
    g.add_argument("--lpm-max-wait-steps", type=int, default=d.lpm_max_wait_steps,
                   help="lpm's bound for cold requests: one that has waited this many steps "
                        "is admitted before any later arrival (docs/conversations.md)")
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--eviction-policy", default=d.eviction_policy, choices=sorted(POLICIES),
                   help="which unlocked prefix the cache evicts first (docs/replay.md)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-queue-len", type=int, default=d.max_queue_len)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--debug-invariants", action="store_true")
    g.add_argument("--max-pinned-tokens", type=parse_tokens, default=None,
                   help="tokens that POST /cache/pin may keep in the KV pool, never evicted "
                        "(default: a quarter of the pool; 0: pinning off). Lowered so that "
                        "a request of the full context still fits beside them")
    g.add_argument("--warmup-tokens", type=int, default=None,
                   help=f"tokens of a throw-away prefill run at start-up, before /health says "
                        f"ready (default: {d.warmup_tokens}; 0: off; --chunked-prefill-size "
                        f"grows the heap to a full step's size, for benchmarks)")
    g.add_argument("--kv-host-tokens", type=parse_tokens, default=None,
                   help="host-memory tier below the KV pool, in tokens (e.g. 256k): evicted "
                        "prefixes are copied there and loaded back (default: none; "
                        "docs/tiers.md)")
    g.add_argument("--kv-host-bytes", type=parse_bytes, default=None,
                   help="the host tier's size in bytes instead (e.g. 8GiB)")
    g.add_argument("--weights-cache-dir", default=None,
                   help="where a GGUF's dequantized weights are kept between starts (default: "
                        "$RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve)")
    g.add_argument("--deterministic", action="store_true",
                   help="the same request gives the same tokens whatever else runs, cache "
                        "on or off (greedy, or sampled with a seed); slower: see "
                        "docs/deterministic.md")
    g.add_argument("--no-weights-cache", action="store_true",
                   help="dequantize GGUF weights at every start; write no cache")
    g.add_argument("--kv-disk-dir", default=None,
                   help="directory of KV pages on disk, one store: the tier below host "
                        "memory (evicted prefixes written there, checksummed, and loaded "
                        "back) and the cache kept across restarts: written on SIGTERM and "
                        "POST /cache/save, back as disk-tier nodes at start (docs/tiers.md)")
    g.add_argument("--kv-disk-bytes", type=parse_bytes, default=None,
                   help=f"at most this many bytes of pages in --kv-disk-dir, e.g. 20GiB, for "
                        f"the disk tier and the saved cache together (default "
                        f"{DEFAULT_KV_DISK_BYTES // 2**30}GiB)")
    g.add_argument("--weights-dtype", default=d.weights_dtype,
                   choices=["auto", "bf16", "int8", "int4", "int4+float"],
                   help="how linear weights are held and multiplied: int8 (per row) or int4 "
                        "(groups of 32) through torch's CPU weight-only kernels, bf16 as "
                        "--dtype; auto: the GGUF's own precision (a Q4 file runs int4, a "
                        "Q8_0 one int8, float files bf16; CUDA: bf16); int4+float: int4 for "
                        "steps of few rows beside the float weights. docs/configuration.md")
    g.add_argument("--grammar-cache-dir", default=None,
                   help="where compiled grammars (response_format, tools) are kept between "
                        "starts (default: <weights cache dir>/grammars)")
    g.add_argument("--no-grammar-cache", action="store_true",
                   help="keep compiled grammars in memory only")
    g.add_argument("--grammar-compile-timeout-s", type=float, default=None,
                   help=f"a grammar that takes longer to compile gets a 400 (default "
                        f"{d.grammar_compile_timeout_s:g})")
    g.add_argument("--grammar-prewarm", type=int, default=DEFAULT_GRAMMAR_PREWARM,
                   metavar="N",
                   help=f"at start, rebuild the N most recently used grammars of the disk "
                        f"cache in the background, so the first requests after a restart "
                        f"compile nothing (default {DEFAULT_GRAMMAR_PREWARM}; 0: off)")
    e = parser.add_argument_group("KV cache events (vLLM's contract; docs/scale-out.md)")
    e.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish KV cache events on this ZeroMQ PUB endpoint, e.g. "
                        "tcp://*:5557 (bound; an endpoint without a wildcard is connected to)")
    e.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="ZeroMQ ROUTER endpoint answering replay requests, e.g. tcp://*:5558")
    e.add_argument("--kv-events-topic", default=None,
                   help="topic frame of every message (llm-d: kv@<pod>@<model>; default empty)")
    e.add_argument("--kv-events-block-size", type=int, default=None,
                   help=f"tokens per announced block, a multiple of --page-size; match the "
                        f"router's block size (default {d.kv_events_block_size})")
    e.add_argument("--kv-events-encoding", default=None, choices=["array", "map"],
                   help=f"msgpack shape of the events: array (vLLM's array_like structs, what "
                        f"llm-d decodes) or map (vLLM since vllm#42892) (default "
                        f"{d.kv_events_encoding})")
    e.add_argument("--kv-events-publisher", default=None, choices=["process", "thread"],
                   help=f"where the events are computed and sent: process (a process of "
                        f"its own, so the scheduler never waits for its GIL) or thread (a "
                        f"thread of the engine's, for a host with one core) (default "
                        f"{d.kv_events_publisher})")
    e.add_argument("--kv-events-interval-ms", type=float, default=None,
                   help=f"while the engine is busy, its steps' changes go to the publisher "
                        f"at most this often, as one batch (at once when it goes idle, and "
                        f"after a flush); 0: after every step, as vLLM does (default "
                        f"{d.kv_events_interval_ms:g})")
    g.add_argument("--kv-window-pool", default=d.kv_window_pool, choices=["auto", "off"],
                   help="hybrid models: keep the sliding-window layers' KV in their own pool, "
                        "only the windows a running request or a cached match point needs "
                        "(auto: when the model has one window size; off: full KV in every "
                        "layer). docs/models.md")
    g.add_argument("--kv-window-pool-fraction", type=float, default=None,
                   help=f"the windowed pool's pages per full-attention page (default "
                        f"{d.kv_window_pool_fraction:g})")
    g.add_argument("--kv-window-checkpoint", type=parse_tokens, default=None,
                   help="tokens between the match points whose windows the cache keeps "
                        "along a path (default: 16 windows)")
    g.add_argument("--kv-disk-journal-sync-ms", type=int, default=None,
                   help=f"fsync the disk tier's journal of page writes and drops this often "
                        f"(default {d.kv_disk_journal_sync_ms}; 0: at every record): what a "
                        f"power loss may lose; a kill -9 loses nothing (docs/tiers.md)")
    g.add_argument("--kv-share", type=share_arg, default=None, metavar="off|ray|dir:PATH",
                   help="share computed prefixes between replicas: a replica publishes the KV "
                        "pages of each prompt it computes, another that misses them loads "
                        "them while that is cheaper than computing. ray: Ray's object store "
                        "(with --replicas); dir:PATH: page files in a shared directory "
                        "(default off; docs/scale-out.md)")
    g.add_argument("--kv-share-bytes", type=parse_bytes, default=None,
                   help="at most this many bytes of shared pages in the cluster store "
                        "(default 4GiB; least recently used out first)")
    g.add_argument("--kv-share-lookup-min-s", type=float, default=None,
                   help=f"a cluster-store lookup unanswered after as long as computing its "
                        f"pages takes (measured), and at least this, is a miss: the request "
                        f"computes them (default {d.kv_share_lookup_min_s:g})")
    g.add_argument("--kv-share-call-timeout-s", type=float, default=None,
                   help=f"--kv-share ray: a directory actor call or a page's object get "
                        f"slower than this is a miss (default {d.kv_share_call_timeout_s:g})")
    g.add_argument("--decode-compile", default=None, choices=["off", "on", "auto"],
                   help="run a lone decode (one stream) through a compiled step, kept in "
                        "the weights cache dir; compiled in the background on a cold cache "
                        "while serving eagerly. auto: where the model qualifies; on: refuse "
                        "to start where it does not (default: serve auto, unless "
                        "$RADIXSERVE_DECODE_COMPILE says otherwise; other commands off; "
                        "docs/configuration.md)")
