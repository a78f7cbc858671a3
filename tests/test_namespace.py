"""The installed names: everything under ``mla_compile``; the bare pre-namespace names are
deprecated aliases of the very same modules (never second copies)."""

import subprocess
import sys

import pytest


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_namespaced_imports_need_no_bare_names(tmp_path) -> None:
    """A user's own ``export.py`` (or ``mla_ops.py``) in the working directory shadows nothing of
    ours: the namespaced packages import and the backend resolves."""
    for name in ("export", "mla_ops", "fx_passes"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('the user module was imported')\n")
    done = _run(
        "import torch\n"
        "from mla_compile import export, fx_passes, mla_ops\n"
        "assert hasattr(torch.ops.mla, 'decode')\n"
        "f = torch.compile(lambda x: x * 2, backend='mla')\n"
        "print(f(torch.ones(2)).tolist())\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[2.0, 2.0]" in done.stdout
    assert "is deprecated and goes in the next release" not in done.stderr


@pytest.mark.parametrize("name", ["mla_ops", "fx_passes", "export"])
def test_bare_names_warn_and_alias(name: str, tmp_path) -> None:
    """``import mla_ops`` (and its submodules) warns once and gives ``mla_compile.mla_ops``'s module
    objects, so the ops are registered once."""
    sub = {"mla_ops": "ops", "fx_passes": "absorb", "export": "program"}[name]
    done = _run(
        f"import {name}, {name}.{sub}\n"
        f"import mla_compile.{name} as new, mla_compile.{name}.{sub} as new_sub\n"
        f"assert {name} is new, ({name}, new)\n"
        f"assert {name}.{sub} is new_sub\n"
        f"assert new_sub.__spec__.name == 'mla_compile.{name}.{sub}'\n"
        f"from {name}.{sub} import __name__ as sub_name\n"
        "print(sub_name)\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"mla_compile.{name}.{sub}"
    assert done.stderr.count("is deprecated and goes in the next release") == 1, done.stderr
    assert f"import mla_compile.{name} instead" in done.stderr


def test_the_cache_without_transformers_names_the_extra() -> None:
    """``MLACache`` needs transformers (the ``[hf]`` extra): without it the import error says so."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n"
        "    import mla_compile.mla_ops.hf_cache\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "pip install 'mla-compile[hf]'" in done.stdout, done.stdout + done.stderr
