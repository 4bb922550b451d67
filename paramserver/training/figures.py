"""The test figures as every report says them (a server's log and ``status``, ``launch``'s
console and summary), and as JSON records hold them. No torch here: ``paramserver status``
imports it."""

from __future__ import annotations

import math


def figures(
    accuracy: float | None,
    loss: float,
    auc: float | None = None,
    perplexity: float | None = None,
) -> str:
    """The test figures as every report says them ("accuracy 84.20%, loss 0.4512"; an AUC
    and a perplexity where there is one, no accuracy where the outputs are not classes)."""
    parts = []
    if accuracy is not None and math.isfinite(accuracy):
        parts.append(f"accuracy {100 * accuracy:.2f}%")
    if auc is not None and math.isfinite(auc):
        parts.append(f"AUC {auc:.4f}")
    parts.append(f"loss {loss:.4f}")
    if perplexity is not None and math.isfinite(perplexity):
        parts.append(f"perplexity {perplexity:.2f}")
    return ", ".join(parts)


def finite(value: float | None) -> float | None:
    """``value`` for a JSON record: None for a NaN or an infinity (JSON has neither)."""
    return value if value is not None and math.isfinite(value) else None
