"""Adversarial tests: peers without the token, other local
processes and workers that lie, against real servers. Run them as one suite:
``pytest tests/adversarial``."""
