"""The examples run as the README documents them and report what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_export_onnx_example(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "export_onnx.py"),
            "--out",
            str(tmp_path / "s.onnx"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    errors = [float(e) for e in re.findall(r"relative error (\S+)", done.stdout)]
    assert len(errors) == 3 and max(errors) <= 1e-4, done.stdout
