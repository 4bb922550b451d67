"""Test hosts in Linux network namespaces: the package's (``paramserver.cluster.netns``)."""

from paramserver.cluster.netns import Network, leftovers, rate_bits, unavailable

__all__ = ["Network", "leftovers", "rate_bits", "unavailable"]
