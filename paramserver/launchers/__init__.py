"""Components for launchers outside paramserver: ``torchx`` (a torchx AppDef of the server
and worker roles, whose processes find each other through ``cluster.torchx_roles``).

Layering: may import ``cluster`` and everything below it, and the launcher's own package;
nothing of paramserver imports it (the launcher does, by name).
"""
