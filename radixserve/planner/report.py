"""The plan as text for people (`radixserve plan`) — `--json` prints the Plan's fields."""

from __future__ import annotations

from radixserve.planner.capacity import Plan


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n):,} B"


def format_plan(p: Plan) -> str:
    served = "yes" if p.served_by_radixserve else f"no: {p.not_served_because}"
    lines = [
        f"model            {p.model} ({p.architecture}, {p.attention})",
        f"served here      {served}",
        f"shape            {p.num_layers} layers, {p.num_heads} attention heads, "
        f"{p.num_kv_heads} KV heads, head dim {p.head_dim}",
    ]
    if p.sliding_windows:
        per = ", ".join(f"{n} layers with window {w}" for w, n in p.sliding_windows.items())
        lines.append(f"sliding window   {per} (of {p.num_layers})")
    if len(p.layer_groups) > 1:
        lines.append("layer groups     " + "; ".join(
            f"{'full attention' if g['window'] is None else 'window ' + str(g['window'])}: "
            f"{g['num_layers']} layers, {g['bytes_per_token']:,} B/token"
            for g in p.layer_groups))
    if p.window_pool_pages is not None:
        lines.append(f"window pool      {p.window_pool_pages:,} pages of {p.page_size} for the "
                     f"windowed layers, beside {p.pool_pages:,} full-attention pages")
    lines += [
        f"KV format        {p.kv_format}",
        f"KV per token     {p.formula} ({human_bytes(p.kv_bytes_per_token)})",
    ]
    if p.mla_uncompressed_bytes_per_token:
        lines.append(f"                 without MLA it would be "
                     f"{p.mla_uncompressed_bytes_per_token:,} B "
                     f"({p.mla_uncompressed_bytes_per_token / p.kv_bytes_per_token:.1f}x)")
    lines.append(f"weights          {p.num_params:,} parameters ({p.params_source}) x "
                 f"{p.weights_dtype} = {human_bytes(p.weight_bytes)}")
    if p.kv_budget_bytes is None:
        budget = "--kv-cache-tokens"
    elif p.device == "cuda":
        budget = (f"({human_bytes(p.memory_bytes)} - weights) x memory fraction = "
                  f"{human_bytes(p.kv_budget_bytes)}")
    else:
        budget = f"CPU default {human_bytes(p.kv_budget_bytes)}"
    lines += [
        f"KV pool          {p.pool_tokens:,} tokens ({p.pool_pages:,} pages of "
        f"{p.page_size}), {human_bytes(p.pool_bytes)} ({p.pool_bytes:,} bytes); "
        f"budget {budget}",
        f"fits             {p.max_concurrency_at_context:,} requests at {p.context:,} "
        f"tokens each; {p.max_context_at_concurrency:,} tokens each for "
        f"{p.concurrency:,} requests",
    ]
    if p.window_aware_max_concurrency is not None:
        lines.append(f"                 a window-aware cache: "
                     f"{human_bytes(p.window_aware_bytes_per_request)} per request at "
                     f"{p.context:,} tokens, {p.window_aware_max_concurrency:,} requests")
    if p.shared_prefix_tokens:
        more = p.max_concurrency_with_shared_prefix
        lines.append(
            f"shared prefix    {p.shared_prefix_tokens:,} tokens: {p.shared_prefix_pages:,} "
            f"pages held once instead of {p.concurrency:,} times saves "
            f"{human_bytes(p.shared_prefix_saved_bytes)}; "
            + ("every request's context is the prefix" if more is None else
               f"{more:,} requests at {p.context:,} tokens fit with it"))
    lines += [f"note             {n}" for n in p.notes]
    return "\n".join(lines)
