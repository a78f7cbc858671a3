"""The examples run as the README documents them and report what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    """The main job's example: every way's tokens equal the original's, the table has a row per
    way, the rewrite expands no K/V per step, and the progress bars count every sequence's
    tokens (2 sequences x 8 tokens)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate.py"), "--backend", "mla_eager",
         "--max-new-tokens", "8", "--ways", "original,mla"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outputs: identical" in done.stdout, done.stdout
    row = r"^\s+(original|backend=\"mla\")\s+([\d.]+)\s+(\d+)\s+(.+)$"
    rows = re.findall(row, done.stdout, re.M)
    assert [name for name, *_ in rows] == ["original", 'backend="mla"'], done.stdout
    assert rows[1][3].strip() == "none" and rows[0][3].strip().endswith("MiB"), done.stdout
    assert re.search(r"backend=\"mla\": .*\| \d+/16 \[", done.stderr), done.stderr[-2000:]


def test_generate_example_refuses_a_missing_checkpoint(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate.py"), "--model", "/nonexistent"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--model /nonexistent: no such directory" in done.stderr, done.stderr[-2000:]


def readme_snippets() -> list[str]:
    """The README's Python code blocks, in order."""
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.slow
def test_readme_snippets_run_as_written(tmp_path, monkeypatch) -> None:
    """Every Python block of the README, in order, in one namespace, on CPU; ``path`` is a tiny
    DeepSeek-V3 checkpoint built the way transformers builds by default. Then what they claim:
    the compiled model's tokens equal the original's, the cache holds latents, the exported
    program runs."""
    transformers = pytest.importorskip("transformers")
    from tests.fx_passes.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", dtype=torch.float32)
    model.save_pretrained(tmp_path / "checkpoint")
    monkeypatch.chdir(tmp_path)
    snippets = readme_snippets()
    assert len(snippets) == 4, "the README's Python blocks changed: update this test"
    namespace = {"path": str(tmp_path / "checkpoint")}
    outputs = []  # `out` after each block: the one-line change's, then the latent cache's
    for snippet in snippets:
        exec(compile(snippet, "README.md", "exec"), namespace)
        outputs.append(namespace.get("out"))
    want = transformers.AutoModelForCausalLM.from_pretrained(namespace["path"]).generate(
        namespace["input_ids"], attention_mask=namespace["mask"], max_new_tokens=32
    )
    assert torch.equal(outputs[0], want) and torch.equal(outputs[1], want)
    assert torch._dynamo.utils.counters["mla"]["absorbed_sites"] > 0
    assert (tmp_path / "decode.onnx").exists() and (tmp_path / "decode_aoti.pt2").exists()
    assert namespace["logits"].shape[:2] == namespace["ids"].shape
