"""Two replicas of the real default model on a local Ray cluster, behind the HTTP front end,
sharing prefixes through Ray's object store (`--kv-share ray`).

One cluster for the module (loading a replica is the slow part); the tests that kill a
replica run last, the sharing faults (a corrupted object, the directory actor restarting,
the publisher dying) just before them. Every wait is on a condition (a view, a stream's end), bounded
by a generous timeout that only a hang reaches.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import jsonschema
import pytest

try:
    import ray
except ImportError as exc:        # like the model fixtures: fail with the command that fixes it
    raise ImportError("the Ray tests need the ray extra: pip install -e '.[dev,ray]'") from exc

from radixserve.cluster.launch import deploy                     # noqa: E402
from radixserve.cluster.options import ClusterOptions            # noqa: E402
from radixserve.cluster.prefix_hashes import prompt_hashes       # noqa: E402
from radixserve.cluster.route_info import RouteInfo              # noqa: E402
from radixserve.engine.sampling_params import SamplingParams     # noqa: E402
from radixserve.server.app import bound_address, drain_and_stop, start_server  # noqa: E402
from radixserve.server.auth import AuthConfig, cache_namespace  # noqa: E402
from radixserve.server.state import ServerConfig, ServerState   # noqa: E402
from radixserve.share.framing import unframe                     # noqa: E402
from radixserve.share.ray_store import ACTOR_NAME, ACTOR_NAMESPACE  # noqa: E402
from tests.server.conftest import engine_config                  # noqa: E402
from tests.server.http import SSEStream, get, post               # noqa: E402
from tests.server.live import LiveServer                         # noqa: E402

pytestmark = pytest.mark.timeout(900)

HANG = 120.0          # seconds: only a hang (or a dead machine) gets this far
# A replacement replica's start (Ray's worker, torch, the model, the warm-up): ~15 s idle,
# ~205 s measured beside two busy loops on 2 cores. A wait for one to rejoin is bounded by
# this, not HANG: a busy machine is slow, not hung.
REPLICA_START = 900.0

SYSTEM = list(range(1000, 1000 + 96))          # 96 tokens: 6 routing blocks
K1, K2, ADMIN = "tenant-one", "tenant-two", "the-admin"


def prompt(tail: int, n: int = 8) -> list[int]:
    return SYSTEM + list(range(2000 + tail * n, 2000 + tail * n + n))


def forgotten(client, victim: str) -> bool:
    """The router keeps no view of `victim` for routing. Ray Serve tells the router of a
    dead replica from the failed request's done callback, scheduled onto the router's
    event loop: on a busy machine that can run after the stream's error reached the
    client, so tests wait for this rather than assert it at the stream's end."""
    with client.state.lock:
        state = client.state.replicas.get(victim)
        return state is None or state.digest is None


def wait_until(cond, what: str, timeout: float = HANG):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


@pytest.fixture(scope="module")
def cluster():
    options = ClusterOptions(replicas=2, num_cpus=4, replica_cpus=1,
                             routing_stats_period_s=0.1, app_name="radixserve-test")
    # The store's deadlines (a lookup's; each directory actor call's and object get's) are
    # HANG: on a busy machine a slow call must not turn a load into a recompute, a publish
    # into a drop, or a live object into a lost one (each would be a miss the tests count).
    client = deploy(engine_config(kv_cache_tokens=4096, warmup_tokens=0, max_model_len=1024,
                                  page_size=16, kv_share="ray", kv_share_lookup_min_s=HANG,
                                  kv_share_call_timeout_s=HANG),
                    options)
    try:
        with LiveServer(client) as live:
            yield live
    finally:
        from ray import serve
        serve.shutdown()
        ray.shutdown()


def generate(live, ids, salt=None, max_tokens=4) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens,
                                                  "temperature": 0}}
    if salt:
        body["cache_salt"] = salt
    reply = post(live.url + "/generate", json=body, timeout=HANG)
    assert reply.status == 200, reply.text
    return reply.json()["meta_info"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def holders(live, ids, salt=None) -> dict[str, int]:
    """Blocks of `ids` (in the namespace of `salt`) each replica's latest digest holds."""
    client = live.engine
    hashes = prompt_hashes(ids, client.state.block_tokens, cache_namespace(None, salt))
    with client.state.lock:
        return {rid: len(set(hashes) & s.digest.hashes) if s.digest else 0
                for rid, s in client.state.replicas.items()}


def hit_tokens(live) -> dict[str, int]:
    return {rid: s.prefix_hit_tokens for rid, s in live.run(live.engine.refresh_stats()).items()}


def test_repeated_system_prompt_goes_to_the_replica_that_has_it(cluster):
    live = cluster
    assert post(live.url + "/cache/flush").status == 200
    generate(live, prompt(0))
    # the view learns which replica holds the system prompt (the digest's lag, measured)
    owner = wait_until(lambda: [r for r, n in holders(live, SYSTEM).items() if n == 6],
                       "a digest holding the system prompt")
    assert len(owner) == 1
    before = hit_tokens(live)
    for i in range(1, 5):
        meta = generate(live, prompt(i))
        assert meta["cached_tokens"] >= len(SYSTEM), meta
    after = hit_tokens(live)
    gained = {r: after[r] - before.get(r, 0) for r in after}
    assert gained[owner[0]] >= 4 * len(SYSTEM)
    assert sum(gained.values()) == gained[owner[0]]           # nothing hit elsewhere


def test_two_namespaces_never_share_hits(cluster):
    live = cluster
    ids = prompt(10)
    assert generate(live, ids, salt="tenant-a")["cached_tokens"] == 0
    wait_until(lambda: max(holders(live, ids, "tenant-a").values()) > 0, "tenant-a's digest")
    assert max(holders(live, ids, "tenant-b").values()) == 0   # no hash shared, even in routing
    assert generate(live, ids, salt="tenant-b")["cached_tokens"] == 0
    assert generate(live, ids, salt="tenant-b")["cached_tokens"] >= 96


def test_flush_empties_every_replica_and_the_router_view(cluster):
    live = cluster
    generate(live, prompt(20))
    with SSEStream(live.url + "/generate", {"input_ids": prompt(21), "stream": True,
                                            "sampling_params": {"max_new_tokens": 400,
                                                                "ignore_eos": True}},
                   timeout=HANG) as stream:
        next(stream.events())                                   # it is running now
        busy = post(live.url + "/cache/flush")
        assert busy.status == 409 and busy.json()["error"]["code"] == "cache_busy"
    wait_until(lambda: all(s.running + s.waiting == 0
                           for s in live.run(live.engine.refresh_stats()).values()),
               "the aborted stream to leave its replica")
    reply = post(live.url + "/cache/flush")
    assert reply.status == 200, reply.text
    with live.engine.state.lock:
        views = {r: len(s.digest.hashes) for r, s in live.engine.state.replicas.items()}
    assert views and set(views.values()) == {0}
    stats = get(live.url + "/cache/stats").json()
    assert set(stats["replicas"]) == set(views)
    assert all(r["pool"]["pages_cached"] == 0 for r in stats["replicas"].values())
    assert stats["pool"]["pages_cached"] == 0
    for rid in views:                                   # page conservation on each replica
        live.run(live.engine.control(rid, "check"))


def test_tenant_keys_read_and_flush_their_namespace_on_every_replica(cluster):
    """Per-key namespaces with --replicas: a tenant's /cache/stats sums every replica and
    its /cache/flush empties its namespace on every replica, leaving the other tenant's."""
    live = cluster
    auth = AuthConfig((K1, K2), namespace_per_api_key=True, admin_keys=(ADMIN,))
    state = ServerState.create(live.engine, ServerConfig(port=0, auth=auth))
    front = live.run(start_server(state, "127.0.0.1", 0))       # a second front end, keyed
    url = "http://%s:%d" % bound_address(front)
    ns1 = auth.key_namespace(K1)

    def on_replicas(op: str) -> dict:
        return {rid: live.run(live.engine.control(rid, op, ns1)).value
                for rid in live.engine.replica_ids()}

    def stats(key: str) -> dict:
        reply = get(url + "/cache/stats", headers=bearer(key))
        assert reply.status == 200 and set(reply.json()) == {"namespace"}, reply.text
        return reply.json()["namespace"]

    try:
        for i in range(8):        # distinct prefixes, one at a time: each to its home replica
            ids = list(range(3000 + 100 * i, 3064 + 100 * i))      # no shared first block
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
            assert post(url + "/generate", json=body, headers=bearer(K1)).status == 200
        body = {"input_ids": prompt(90), "sampling_params": {"max_new_tokens": 1}}
        assert post(url + "/generate", json=body, headers=bearer(K2)).status == 200
        per_replica = on_replicas("namespace_stats")
        assert len(per_replica) == 2 and all(c["cached_tokens"] > 0
                                             for c in per_replica.values())
        k1 = stats(K1)
        assert k1["cached_tokens"] == sum(c["cached_tokens"] for c in per_replica.values())
        k2 = stats(K2)
        assert 0 < k2["cached_tokens"] < k1["cached_tokens"]

        reply = post(url + "/cache/flush", headers=bearer(K1))
        assert reply.status == 200 and reply.json()["scope"] == "namespace", reply.text
        assert reply.json()["freed_pages"] > 0
        assert all(c["cached_tokens"] == 0 for c in on_replicas("namespace_stats").values())
        assert stats(K1)["cached_tokens"] == 0 and stats(K2) == k2
        for rid in live.engine.replica_ids():               # page conservation
            live.run(live.engine.control(rid, "check"))
    finally:
        live.run(drain_and_stop(front, 1.0))


def test_metrics_have_a_replica_label(cluster):
    live = cluster
    generate(live, prompt(30))
    text = get(live.url + "/metrics").text
    ids = live.engine.replica_ids()
    for rid in ids:
        assert f'radixserve_replica_prefix_cache_queries_tokens_total{{replica="{rid}"}}' in text
        assert f'radixserve_router_view_age_seconds{{replica="{rid}"}}' in text
        assert f'radixserve_router_requests_total{{replica="{rid}"}}' in text
    assert "radixserve_prefix_cache_queries_tokens_total " in text       # the cluster total
    assert "radixserve_router_decisions_total " in text


def test_slow_routing_stats_do_not_block_routing(cluster):
    live = cluster
    ids = live.engine.replica_ids()
    for rid in ids:                          # far beyond the routing-stats timeout (5 s)
        live.run(live.engine.control(rid, "stats_delay", 3600.0))
    try:
        for i in range(4):
            assert generate(live, prompt(40 + i))["prompt_tokens"] == len(prompt(0))
    finally:
        for rid in ids:
            live.run(live.engine.control(rid, "stats_delay", 0.0))


def test_structured_outputs_and_tools_through_replicas(cluster):
    """A compiled grammar cannot cross processes: the front end compiles it (bad schemas
    get their 400 there), the replica compiles the spec it is sent (a cache hit). A JSON
    schema and a forced tool call both hold through a replica."""
    live = cluster
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Pick a digit."}]
    body = {"messages": ask, "max_tokens": 16, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "digit", "schema": schema, "strict": True}}}
    reply = post(live.base_url + "/chat/completions", json=body, timeout=HANG)
    assert reply.status == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["choices"][0]["message"]["content"]), schema)
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    body = {"messages": ask, "max_tokens": 40, "temperature": 0, "tools": [tool],
            "tool_choice": "required"}
    reply = post(live.base_url + "/chat/completions", json=body, timeout=HANG)
    assert reply.status == 200, reply.text
    choice = reply.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "pick"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    bad = post(live.base_url + "/chat/completions", timeout=HANG, json={
        **body, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status == 400 and bad.json()["error"]["param"] == "tool_choice"


# ---- --kv-share ray: a prefix computed on one replica is loaded by the other; faults ----

SHARED_PAGES = 10                       # a shared prompt's loadable pages (16 tokens each)


def shared_prompt(tag: int) -> list[int]:
    """160 tokens no other test uses (10 whole pages) and an 8-token question."""
    return list(range(5000 + 200 * tag, 5160 + 200 * tag)) + list(range(40, 48))


def on_replica(live, rid: str, ids: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
    """Greedy tokens and cached tokens of `ids` served by replica `rid` (the call pinned to
    it, as a control call is); asserts it finished without an error."""
    async def go():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        stream = live.engine.handle.options(stream=True).generate.remote(
            RouteInfo(target=rid), ids, params, None, uuid.uuid4().hex)
        tokens, cached, last = [], None, None
        async for out in stream:
            tokens += out.token_ids
            cached = out.cached_tokens if cached is None else cached
            last = out
        return tokens, cached, last
    tokens, cached, last = live.run(go(), timeout=HANG)
    assert last.finished and last.finish_reason == "length", (last.finish_reason, last.error)
    return tokens, cached


def share_stats(live, rid: str):
    return live.run(live.engine.control(rid, "stats")).stats.share


def directory():
    return ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)


def directory_keys() -> list[bytes]:
    """The directory actor's entry keys, least recently used first."""
    return ray.get(directory().__ray_call__.remote(lambda d: list(d.entries)), timeout=HANG)


def computed_and_published(live, rid: str, ids: list[int]) -> list[int]:
    """`ids` computed on `rid` from nothing, and its pages handed to the store (published,
    or found there): the greedy tokens, a cache-off reference for the prompt."""
    before = share_stats(live, rid)
    tokens, cached = on_replica(live, rid, ids)
    assert cached == 0
    wait_until(lambda: (lambda s: s.published_pages + s.duplicate_pages
                        - before.published_pages - before.duplicate_pages)(
                            share_stats(live, rid)) >= SHARED_PAGES,
               "the publisher to hand the prompt's pages to the store")
    return tokens


def check_pages(live) -> None:
    for rid in live.engine.replica_ids():
        live.run(live.engine.control(rid, "check"))


def test_a_prefix_computed_on_one_replica_is_loaded_by_the_other(cluster):
    live = cluster
    a, b = live.engine.replica_ids()
    ids = shared_prompt(0)
    reference = computed_and_published(live, a, ids)
    before = share_stats(live, b)
    tokens, cached = on_replica(live, b, ids)
    after = share_stats(live, b)
    assert tokens == reference and cached == 16 * SHARED_PAGES
    assert after.loaded_tokens - before.loaded_tokens == 16 * SHARED_PAGES
    assert after.loads == before.loads + 1 and after.refused_pages == before.refused_pages
    total = get(live.url + "/cache/stats").json()
    assert total["share"]["loaded_tokens"] >= 16 * SHARED_PAGES, total.get("share")
    assert f'radixserve_replica_kv_share_loaded_tokens_total{{replica="{b}"}}' in \
        get(live.url + "/metrics").text
    check_pages(live)


def test_two_replicas_computing_one_prefix_at_once_both_serve_it(cluster):
    """Both replicas get the same new prompt at once: one copy of each page wins in the
    directory (the other is a duplicate, or was never computed: the claim), and both
    replicas serve the same greedy tokens."""
    live = cluster
    a, b = live.engine.replica_ids()
    ids = shared_prompt(1)
    entries = len(directory_keys())
    published = {r: share_stats(live, r).published_pages for r in (a, b)}
    with_a, with_b = {}, {}
    threads = [threading.Thread(target=lambda r=r, out=out: out.update(
        got=on_replica(live, r, ids))) for r, out in ((a, with_a), (b, with_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG)
        assert not t.is_alive(), "a request hung"
    assert with_a["got"][0] == with_b["got"][0]
    assert min(with_a["got"][1], with_b["got"][1]) == 0     # one computed it from nothing
    wait_until(lambda: sum(share_stats(live, r).published_pages - published[r]
                           for r in (a, b)) >= SHARED_PAGES, "the prompt's pages published")
    assert sum(share_stats(live, r).published_pages - published[r]
               for r in (a, b)) == SHARED_PAGES             # each page once, cluster-wide
    assert len(directory_keys()) == entries + SHARED_PAGES
    check_pages(live)


def test_a_corrupted_shared_object_is_refused_and_recomputed(cluster):
    """One page's object in the directory is replaced by a copy with a flipped byte: the
    loading replica's CRC check refuses it, loads the pages before it, computes the rest,
    and serves the reference's tokens; the refusal is counted."""
    live = cluster
    a, b = live.engine.replica_ids()
    ids = shared_prompt(2)
    old = set(directory_keys())
    reference = computed_and_published(live, a, ids)
    new = [k for k in directory_keys() if k not in old]
    assert len(new) == SHARED_PAGES
    bad_key = new[4]

    def corrupt(d, key):
        (ref,), owner, size = d.entries[key]
        blob = bytearray(ray.get(ref))
        blob[-1] ^= 0xFF
        d.entries[key] = ([ray.put(bytes(blob))], owner, size)
    ray.get(directory().__ray_call__.remote(corrupt, bad_key), timeout=HANG)
    before = share_stats(live, b)
    tokens, cached = on_replica(live, b, ids)
    after = share_stats(live, b)
    assert tokens == reference and cached == 4 * 16
    assert after.refused_pages - before.refused_pages == 1
    assert after.loaded_tokens - before.loaded_tokens == 4 * 16
    # The bad copy was forgotten; the loading replica computed that page and published it
    # again (the only page the directory lacked): a good copy is listed now.
    wait_until(lambda: share_stats(live, b).published_pages > before.published_pages,
               "the recomputed page to be published")
    assert share_stats(live, b).published_pages == before.published_pages + 1

    def listed_blob(d, key):
        (ref,), _, _ = d.entries[key]
        return ray.get(ref)
    unframe(bad_key, ray.get(directory().__ray_call__.remote(listed_blob, bad_key),
                             timeout=HANG))                 # raises BadBlob if corrupt
    check_pages(live)


def test_the_directory_actor_restarting_loses_nothing_and_sharing_resumes(cluster):
    """Ray restarts the killed directory actor, empty: the pages it listed are forgotten
    (a replica missing them computes them), and a prefix published after the restart is
    loaded by the other replica again. Every answer equals its cache-off reference."""
    live = cluster
    a, b = live.engine.replica_ids()
    old = shared_prompt(3)
    old_reference = computed_and_published(live, a, old)
    ray.kill(directory(), no_restart=False)

    def restarted():
        try:
            return ray.get(directory().size.remote(), timeout=5.0)["entries"] == 0
        except (ray.exceptions.RayError, ValueError):
            return False
    wait_until(restarted, "the directory actor to come back, empty")
    before = share_stats(live, b)
    assert on_replica(live, b, old) == (old_reference, 0)       # forgotten: computed
    assert share_stats(live, b).loaded_tokens == before.loaded_tokens
    tag = 4
    while True:          # a publish racing the restart may be dropped: take the next prompt
        ids = shared_prompt(tag)
        published = share_stats(live, a).published_pages
        reference = computed_and_published(live, a, ids)
        loaded = share_stats(live, b).loaded_tokens
        assert on_replica(live, b, ids)[0] == reference
        if share_stats(live, b).loaded_tokens > loaded:
            break
        assert share_stats(live, a).published_pages == published, \
            "published after the restart, yet not loaded"
        tag += 1
        assert tag < 10, "sharing did not resume after the directory restarted"
    check_pages(live)


def test_the_publisher_dying_leaves_the_others_recomputing(cluster):
    """The replica that published a prefix is killed: its objects die with it, so the
    other replica's load fails, the directory forgets them, and it computes the prompt
    (the reference's tokens, no error, no hang); the replacement replica then loads the
    prefix from the survivor's publication."""
    live = cluster
    client = live.engine
    # (a replacement for a replica an earlier test killed may still be starting)
    wait_until(lambda: len(client.replica_ids()) == 2, "two replicas", REPLICA_START)
    a, b = client.replica_ids()
    ids = shared_prompt(10)
    old = set(directory_keys())
    reference = computed_and_published(live, a, ids)
    first = next(k for k in directory_keys() if k not in old)
    os.kill(live.run(client.control(a, "pid")), signal.SIGKILL)

    def lost(d, key):       # in the directory actor: has Ray declared the object lost?
        (ref,), _, _ = d.entries[key]
        try:
            ray.get(ref, timeout=5.0)
            return False
        except ray.exceptions.ObjectLostError:      # OwnerDiedError among them
            return True
        except ray.exceptions.GetTimeoutError:      # a busy machine: not known yet, ask again
            return False
    # Ray frees a dead owner's objects once it learns of the death (until then a read of
    # the node's copy still succeeds, with correct, checked bytes): wait for that.
    wait_until(lambda: ray.get(directory().__ray_call__.remote(lost, first), timeout=HANG),
               "Ray to report the dead publisher's objects lost")
    before = share_stats(live, b)
    assert on_replica(live, b, ids) == (reference, 0)
    after = share_stats(live, b)
    assert after.forgotten_pages > before.forgotten_pages
    assert after.loaded_tokens == before.loaded_tokens
    wait_until(lambda: share_stats(live, b).published_pages
               >= before.published_pages + SHARED_PAGES,
               "the survivor to publish the prompt")
    new = wait_until(lambda: [r for r in client.replica_ids() if r not in (a, b)],
                     "the replacement replica to rejoin", REPLICA_START)[0]
    assert on_replica(live, new, ids) == (reference, 16 * SHARED_PAGES)
    assert share_stats(live, new).loaded_tokens == 16 * SHARED_PAGES
    check_pages(live)


def test_a_replica_dying_mid_stream_ends_cleanly_and_the_next_requests_succeed(cluster):
    live = cluster
    client = live.engine
    body = {"input_ids": prompt(50), "stream": True,
            "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    with SSEStream(live.url + "/generate", body, timeout=HANG) as stream:
        events = stream.events()
        first = json.loads(next(events))
        assert first["finished"] is False
        victim = wait_until(lambda: [r for r, s in list(client.state.replicas.items())
                                     if s.in_flight], "the stream's replica")[0]
        with pytest.raises(Exception):
            live.run(client.control(victim, "exit"))
        rest = list(events)                             # ends: no hang
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    assert last["finished"] is True and last["meta_info"]["finish_reason"] == "error"
    wait_until(lambda: forgotten(client, victim), "the router to forget the dead replica")
    for i in range(3):                                  # retried or routed elsewhere
        assert generate(live, prompt(60 + i))["prompt_tokens"] == len(prompt(0))


STREAMS = 32


def run_streams(live, first: int) -> tuple[list[threading.Thread], list[list[dict]], threading.Event]:
    """STREAMS concurrent /generate streams; each one's parsed events land in its list."""
    events: list[list[dict]] = [[] for _ in range(STREAMS)]
    one_streamed = threading.Event()

    def stream(i: int) -> None:
        body = {"input_ids": prompt(first + i), "stream": True,
                "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
        with SSEStream(live.url + "/generate", body, timeout=HANG) as s:
            for data in s.events():
                if data != "[DONE]":
                    events[i].append(json.loads(data))
                    one_streamed.set()
                else:
                    events[i].append({"done": True})
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    return threads, events, one_streamed


# Both faults of issue 39 run under 32 streams: the actor exiting (its process ends) and its
# Ray worker process killed (SIGKILL).
HOW = ["replica exits", "worker process killed"]


@pytest.mark.parametrize("how", HOW)
def test_32_streams_through_a_replica_fault(cluster, how):
    """A replica dies (its Ray worker process gets SIGKILL, or its actor exits) while 32
    streams run: every stream ends (no hang) with [DONE]; one that had streamed ends with
    an error event, one that had not is retried elsewhere and finishes; the router forgets
    the dead replica (when Ray Serve tells it), the front end keeps serving, and the
    replacement rejoins."""
    live, client = cluster, cluster.engine
    # (a replacement for a replica an earlier test killed may still be starting)
    wait_until(lambda: len(client.replica_ids()) == 2, "two replicas", REPLICA_START)
    before = set(client.replica_ids())
    threads, events, one_streamed = run_streams(live, 200 if how == "replica exits" else 300)
    assert one_streamed.wait(HANG)
    # A replica that has sent tokens of a live stream (under load, one with streams in
    # flight may not have sent any yet: all of its streams would be retried, none end in
    # an error, and the test could not check that case).
    victim = wait_until(lambda: [r for r in client.replica_ids()
                                 if live.run(client.control(r, "streaming"))],
                        "a replica streaming tokens")[0]
    if how == "replica exits":
        with pytest.raises(Exception):
            live.run(client.control(victim, "exit"))
    else:
        os.kill(live.run(client.control(victim, "pid")), signal.SIGKILL)
    for t in threads:
        t.join(HANG)
        assert not t.is_alive(), "a stream hung"
    errors = 0
    for stream in events:
        assert stream[-1] == {"done": True}
        last = stream[-2]
        assert last["finished"] is True
        reason = last["meta_info"]["finish_reason"]
        assert reason in ("length", "error"), reason
        if reason == "error":           # only after tokens went out; else it was retried
            errors += 1
            assert any(e["output_ids"] for e in stream[:-2]), stream
        else:
            assert sum(len(e["output_ids"]) for e in stream[:-1]) == 24
    assert errors > 0
    # forgotten: no view of the dead replica is used for routing
    wait_until(lambda: forgotten(client, victim), "the router to forget the dead replica")
    for i in range(3):                                  # the front end keeps serving
        assert generate(live, prompt(400 + i))["prompt_tokens"] == len(prompt(0))
    wait_until(lambda: len(client.replica_ids()) == 2 and set(client.replica_ids()) != before,
               "the replacement replica to rejoin", REPLICA_START)
