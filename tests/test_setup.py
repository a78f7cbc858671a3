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


PINNED = [(".venv-legacy", "transformers==5.14.1"), (".venv-mixed", "transformers==5.17.0")]


@pytest.mark.parametrize(("venv", "release"), PINNED)
def test_pinned_venvs_reuse_the_suite_venv(venv: str, release: str) -> None:
    """A pinned venv installs its transformers release and nothing else itself: the suite's venv
    (torch, Triton, the project's editable install) comes in through a site directory added after
    its own, so the pinned release shadows the suite's transformers."""
    plan = planned(f"{venv}/.installed")
    pth = [line for line in plan.splitlines() if "site.addsitedir" in line]
    assert len(pth) == 1 and pth[0].startswith(".venv/bin/python -c"), plan
    assert f'"$({venv}/bin/python -c' in pth[0] and pth[0].endswith('/suite_venv.pth"'), plan
    installs = [line for line in plan.splitlines() if f"{venv}/bin/python -m pip install" in line]
    assert installs == [f'{venv}/bin/python -m pip install --quiet "{release}"'], plan
