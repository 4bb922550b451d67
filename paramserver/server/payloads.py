"""The server's side of the payload channels (``worker/channel.py``): a push's gradient
and a pull's weights go through the worker's shared segment when the server mapped it at
Join, else through the gRPC stream. The one place the server picks."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, wire
from paramserver.shm import Attachments


class Payloads:
    """Where the payloads of each worker travel."""

    def __init__(self, shared: Attachments):
        self.shared = shared

    def gradient(self, h: pb.PushHeader, rest: Iterator[pb.PushChunk]) -> np.ndarray | None:
        """The push's gradient, from the worker's segment or the stream; None if empty."""
        if h.shm:
            wire.expect_end(rest, "A push through shared memory")
            return None if h.empty else self.shared.gradient(h.worker_id, h.shm_slot)
        if h.empty:
            wire.expect_end(rest)
            return None
        return wire.decode_gradient(rest, h.total_bytes, h.dtype)

    def weights(
        self, request: pb.PullRequest, header: pb.PullHeader, weights: np.ndarray
    ) -> memoryview:
        """The bytes to stream after ``header``: none when the weights went into the
        worker's segment (``header.shm`` says so)."""
        if request.shm:
            self.shared.write_weights(request.worker_id, weights)
            header.shm = True
            return memoryview(b"")
        return compression.as_bytes(weights)
