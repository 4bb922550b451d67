"""The training side around the worker: data sets (``data``: Fashion-MNIST, the synthetic
click log in ``clicks``, users' ``module:function`` data sets), ``evaluation`` (test
accuracy, AUC), ``trainer``, the worker daemon's loop (``paramserver worker``), its
``precision`` (``--amp``) and ``local_steps`` (DiLoCo's local steps, ``ps.LocalSteps``).

May import: ``worker``, ``models``, ``sparse``, ``codec``, ``config``, ``errors``. Never
``server``, ``cluster`` or ``cli``.
"""
