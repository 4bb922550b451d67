"""The model catalogue: the built-in architectures (``zoo``) and how a model is found by
name or ``module:function`` and described to the servers (``catalogue``: parameters,
tables, buffers, the manifest).

Both the server (which builds the model by name to learn its layout and tables) and the
worker and training sides use it, so it sits below them: it may import ``codec``,
``sparse``, ``errors`` and ``config``, and nothing of ``server``, ``worker``, ``training``,
``cluster`` or ``cli``.
"""

from paramserver.models.catalogue import (
    aliases,
    buffers,
    build,
    import_function,
    parameters,
    resolve,
    state,
    state_difference,
    table_specs,
    with_aliases,
)
from paramserver.models.zoo import (
    CLICK_FIELDS,
    CLICK_ROWS,
    DLRM,
    FACTORIES,
    BasicBlock,
    cnn,
    dlrm,
    dlrm_sparse,
    mlp,
    mlp_20m,
    resnet,
)

__all__ = [
    "CLICK_FIELDS",
    "CLICK_ROWS",
    "DLRM",
    "FACTORIES",
    "BasicBlock",
    "aliases",
    "buffers",
    "build",
    "cnn",
    "dlrm",
    "dlrm_sparse",
    "import_function",
    "mlp",
    "mlp_20m",
    "parameters",
    "resnet",
    "resolve",
    "state",
    "state_difference",
    "table_specs",
    "with_aliases",
]
