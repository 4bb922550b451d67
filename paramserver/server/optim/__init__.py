"""The server's optimizer, as the store runs it: pure rules over tensors, no locks, no I/O.

- ``step_rules``: ``--clip-grad-norm``, ``--weight-decay-on matrices``, and a step's
  parameters without a gradient kept as they were;
- ``outer``: Delayed Nesterov (``--optimizer delayed-nesterov``);
- ``user_schedule``: a user's ``torch.optim.lr_scheduler`` factory (``--lr-schedule
  module:function``), its rates step by step;
- ``user_optimizer``: a user's optimizer factory (``--optimizer module:function``), its
  class and parameter groups over a shard's pieces of the flat buffer;
- ``optimizer_resume``: what a resumed optimizer takes from a checkpoint (its state, not
  its settings; another optimizer's state refused, or with ``--switch-optimizer`` dropped).

The lowest room of ``server``. May import: ``models``, ``codec``, ``config``, ``errors``.
"""
