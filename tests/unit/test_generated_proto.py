"""The committed code in paramserver/_proto is what `make proto` makes from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "protos/paramserver/v1/paramserver.proto"),
        ],
        check=True,
    )
    out = tmp_path / "paramserver" / "v1"
    grpc_code = (out / "paramserver_pb2_grpc.py").read_text()
    grpc_code = grpc_code.replace("from paramserver.v1 import", "from paramserver._proto import")
    committed = ROOT / "paramserver" / "_proto"
    assert (committed / "paramserver_pb2_grpc.py").read_text() == grpc_code, "run `make proto`"
    for name in ("paramserver_pb2.py", "paramserver_pb2.pyi"):
        assert (committed / name).read_text() == (out / name).read_text(), (
            f"{name}: run `make proto`"
        )
