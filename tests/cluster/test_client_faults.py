"""RayEngineClient's fault handling, against a scripted stand-in for the DeploymentHandle."""

import asyncio

from ray.exceptions import ActorDiedError

from radixserve.cluster.client import RayEngineClient
from radixserve.cluster.view import ClusterState
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams


class ScriptedStream:
    """One call's response: yields `outputs`, then raises `error` if given."""

    def __init__(self, outputs, error=None):
        self.outputs, self.error, self.cancelled = list(outputs), error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.outputs:
            return self.outputs.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class ScriptedHandle:
    def __init__(self, streams):
        self.streams, self.calls = list(streams), 0
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, *args):
        self.calls += 1
        return self.streams.pop(0)


def out(i, finished=False):
    return RequestOutput("r", 0, [i], str(i), finished=finished,
                         finish_reason="length" if finished else None)


def run(client):
    async def collect():
        return [o async for o in client.generate([1, 2, 3], SamplingParams(max_tokens=2),
                                                 request_id="r")]
    return asyncio.run(collect())


def client_for(streams):
    handle = ScriptedHandle(streams)
    return RayEngineClient(handle, ClusterState(16), num_replicas=2), handle


def test_a_replica_lost_before_streaming_is_retried_elsewhere():
    client, handle = client_for([ScriptedStream([], ActorDiedError()),
                                 ScriptedStream([out(1), out(2, finished=True)])])
    outs = run(client)
    assert handle.calls == 2
    assert [o.finish_reason for o in outs] == [None, "length"]


def test_a_replica_lost_after_streaming_ends_the_request_with_an_error():
    first = ScriptedStream([out(1)], ActorDiedError())
    client, handle = client_for([first])
    outs = run(client)
    assert handle.calls == 1                          # never sent twice: tokens went out
    assert outs[-1].finished and outs[-1].finish_reason == "error"
    assert "failed" in outs[-1].error
    assert client._live == {}


def test_retries_are_bounded():
    client, handle = client_for([ScriptedStream([], ActorDiedError()) for _ in range(3)])
    outs = run(client)
    assert handle.calls == 3 and outs[-1].finish_reason == "error"
