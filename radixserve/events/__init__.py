"""KV cache events on vLLM's wire contract (`--kv-events`): the tree's changes as
BlockStored / BlockRemoved / AllBlocksCleared at a fixed block size (block_events.py),
published on ZeroMQ off the scheduler's thread (publisher.py, stream.py), read back by
subscribers (subscriber.py, `radixserve kv-events`: cli.py) and recordings (recording.py).

Nothing is imported here: the replay tool reads recordings without loading ZeroMQ.
"""
