"""A worker's channel finds a restarted server within about a second of its coming back.

gRPC's own reconnect backoff (1 s, times 1.6 per failed try, up to 120 s) made a worker
whose server was down for ten seconds wait about six more after it came back; in a seeded
``chaos`` soak, one worker thus missed its 3 s lease on the shard that came back first, and
the run's rounds, and its weights, differed from the uninterrupted run's. The channels now
cap that backoff (``transport/stub.py``), under the worker's own retry budget."""

from __future__ import annotations

import time

import grpc

from paramserver.transport.stub import connect

DOWN_S = 10.0  # gRPC's default backoff would try again about 6 s after this (see above)


def test_a_channel_reconnects_within_a_second_or_two_of_the_server_coming_back(serve):
    first = serve("mlp")
    port = first.bound.rsplit(":", 1)[1]
    channel = connect(f"127.0.0.1:{port}", 30)
    try:
        first.stop(grace=0)
        states: list[grpc.ChannelConnectivity] = []
        channel.subscribe(states.append, try_to_connect=True)
        time.sleep(DOWN_S)  # the condition is the time the server was away
        assert grpc.ChannelConnectivity.TRANSIENT_FAILURE in states, states
        serve("mlp", port=int(port))
        back = time.monotonic()
        grpc.channel_ready_future(channel).result(timeout=30)
        waited = time.monotonic() - back
        assert waited < 3.0, f"the channel found the server {waited:.1f}s after it came back"
    finally:
        channel.close()
