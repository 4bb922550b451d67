"""How fast training goes: a worker's step against a local step (``step``), samples/s of 1,
2 and 4 workers with the CPU a step costs (``scaling``), a straggler against DDP
(``straggler``), wall time to 88% Fashion-MNIST accuracy (``accuracy``).

May import: ``bench``'s ``common`` and ``ddp``, ``report``. Never ``wire``, ``tables`` or
``criteo``.
"""
