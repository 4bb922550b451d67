"""The training loss of the built-in worker and of the server's evaluation (``--loss``).

By default, cross-entropy; a model's output with one more dimension than its targets (a
language model's (B, T, V) logits against (B, T) token ids) is taken token by token, as
``F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))`` (torch itself would read
the second dimension as the classes). ``module:function`` names a loss of the user's,
called as ``loss(outputs, targets)`` and returning a scalar tensor, the batch's mean
(``torch.nn.functional:l1_loss`` and the like fit as they are).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from paramserver.models import import_function

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DEFAULT = ""  # cross-entropy, per token for sequences


def per_token(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, target)`` with a sequence's tokens as the samples: (B, T, V) and (B, T)
    become (B·T, V) and (B·T); any other pair is returned as it is."""
    if out.dim() >= 3 and out.dim() == target.dim() + 1 and out.shape[:-1] == target.shape:
        return out.reshape(-1, out.shape[-1]), target.reshape(-1)
    return out, target


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy, over the tokens of a sequence output (``per_token``)."""
    return F.cross_entropy(*per_token(out, target))


def resolve(spec: str) -> Loss:
    """The loss ``spec`` names: "" for ``cross_entropy``, or ``module:function``.

    Raises:
        ConfigError: the function cannot be imported, or cannot take (outputs, targets).
    """
    if spec == DEFAULT:
        return cross_entropy
    return import_function(spec, "loss", arguments=2)  # type: ignore[return-value]
