"""The README's set-up commands install what it says (read from `make -n`, nothing installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def planned(target: str, *variables: str) -> str:
    done = subprocess.run(
        ["make", "-n", "-B", target, *variables], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_torch_comes_from_the_cpu_index_by_default() -> None:
    """CPU torch from PyTorch's CPU-only index (an extra index, so a locally supplied wheel is
    still found; one try if it cannot be reached), then the project with the demo's extras."""
    plan = planned(".venv/.installed-demo")
    assert (
        '--retries 0 --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"' in plan
    ), plan
    assert '-e ".[hf,bench]"' in plan, plan
    assert '-e ".[test,bench]"' in planned(".venv/.installed")


def test_the_torch_index_is_a_choice() -> None:
    cuda = planned(".venv/.installed", "TORCH_INDEX=https://download.pytorch.org/whl/cu130")
    assert "--extra-index-url https://download.pytorch.org/whl/cu130" in cuda
    assert "--extra-index-url" not in planned(".venv/.installed", "TORCH_INDEX=")
