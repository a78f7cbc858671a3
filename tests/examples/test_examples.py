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


@pytest.mark.slow
def test_generate_example(tmp_path) -> None:
    """The main job's example: the rewritten model's tokens equal the original's."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate.py"), "--backend", "mla_eager",
         "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outputs: identical" in done.stdout, done.stdout
    rates = re.findall(r"^\s+(original|backend=mla)\s+([\d.]+)\s+(\d+)$", done.stdout, re.M)
    assert [name for name, _, _ in rates] == ["original", "backend=mla"], done.stdout
