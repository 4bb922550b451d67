"""Where a server shard's weights, optimizer state and pushes live (``--server-device``):
``cpu``, ``cuda`` (a GPU of this host; ``launch`` gives its shard i GPU i modulo the GPUs it
sees) or ``cuda:I``. Checked before anything starts: a GPU asked of a torch that sees none
is one sentence, not a failure after the workers started."""

from __future__ import annotations

import re
from typing import Any

from paramserver.errors import ConfigError

SERVER_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")


def _cuda() -> Any:
    import torch  # not at import: ``status`` and ``health`` read the settings without torch

    return torch.cuda


def _version() -> str:
    import torch

    return str(torch.__version__)


def check_server_device(spec: str, cuda: Any = None) -> None:
    """Raise ConfigError unless ``spec`` names a device this host has (``cuda``: torch's
    CUDA module, or a fake in tests)."""
    if not SERVER_DEVICE.fullmatch(spec):
        raise ConfigError(f"--server-device must be cpu, cuda or cuda:I; got {spec!r}.")
    check_gpu(spec, "--server-device", cuda)


def check_gpu(spec: str, flag: str, cuda: Any = None) -> None:
    """Raise ConfigError if ``spec`` (cuda or cuda:I; anything else passes) names a GPU
    this host's torch does not see."""
    if not spec.startswith("cuda"):
        return
    cuda = cuda or _cuda()
    if not cuda.is_available():
        raise ConfigError(
            f"{flag} {spec} asks for a GPU, but this torch build sees none (torch "
            f"{_version()}); use {flag} cpu, or install a CUDA build of torch."
        )
    count = cuda.device_count()
    if ":" in spec and int(spec.split(":", 1)[1]) >= count:
        raise ConfigError(
            f"{flag} {spec}: this host has {count} GPU{'s' if count != 1 else ''} "
            f"(cuda:0 to cuda:{count - 1})."
        )


def shard_device(spec: str, shard: int, cuda: Any = None) -> str:
    """The device of a launch's shard ``shard``: ``cuda`` spreads the shards over this
    host's GPUs (shard i on GPU i modulo their number); anything else as given."""
    if spec != "cuda":
        return spec
    cuda = cuda or _cuda()
    return f"cuda:{shard % max(1, cuda.device_count())}"
