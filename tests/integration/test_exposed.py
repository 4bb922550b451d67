"""A server that listens on every interface with neither a token nor TLS says so once, with
the risk and the fixes (issue 46); one on loopback, or with a token, says nothing."""

from __future__ import annotations

import logging

import pytest

from paramserver.config import Security, ServerConfig
from paramserver.server import app as app_module

WARNING = "listening on every interface with no token and no TLS"


@pytest.mark.parametrize(
    "host,token,warned",
    [("0.0.0.0", None, True), ("0.0.0.0", "s3cret", False), ("127.0.0.1", None, False)],
)
def test_an_open_server_on_every_interface_is_warned_about(caplog, host, token, warned):
    cfg = ServerConfig(
        host=host, port=0, data_port="off", dataset="synthetic", security=Security(token=token)
    )
    caplog.set_level(logging.WARNING, logger=app_module.__name__)
    with app_module.ServerApp(cfg):
        pass
    said = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert "PARAMSERVER_TOKEN" in said[0] and "--tls-cert" in said[0]
        assert "--host 127.0.0.1" in said[0]
