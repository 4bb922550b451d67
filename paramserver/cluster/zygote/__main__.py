"""``python -m paramserver.cluster.zygote FD [MODULE...]``: started by ``Zygote()``."""

import sys

from paramserver.cluster.zygote import fork

fork.main(int(sys.argv[1]), sys.argv[2:])
