"""``bench sparse``'s recommender case: a Criteo-like click ``stream`` (26 tables of the
Criteo Kaggle cardinalities), its DLRM each way it is held (``model``), the case measured
side by side (``case``) and its processes (``ranks``).

May import: ``bench``'s ``common`` and ``ddp``, ``report``. Never ``tables``, ``throughput``
or ``wire``.
"""
