"""Python-free AOTInductor packages run from C++: ``examples/cpp`` (CMake against the torch
wheel's libtorch) built here, the prefill and decode packages compiled with
``python_free=True``, greedy tokens and logits compared with eager PyTorch. A package that calls
the ``mla`` ops back through Python fails there, naming the op."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mla_compile import export, mla_ops
from mla_compile.export import DecodeStep, PrefillStep, prompt_inputs
from tests.export.helpers import float32_model, relative_error

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(
        shutil.which("cmake") is None or shutil.which("c++") is None,
        reason="the C++ runner needs cmake and a C++ compiler",
    ),
    # torch.export of a plain module says it, about torch's own pytree use
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning"),
]


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Path:
    """``examples/cpp`` configured and built against the installed torch."""
    import torch.utils

    build = tmp_path_factory.mktemp("cpp")
    for command in (
        ["cmake", "-S", str(ROOT / "examples/cpp"), "-B", str(build),
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
        ["cmake", "--build", str(build)],
    ):  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return build / "mla_generate"


def eager_greedy(model, ids, mask, positions, new_tokens: int):
    """The runner's loop in PyTorch: ``(tokens [B, new_tokens], logits [new_tokens, B, V])``."""
    tokens, logits = [], []
    with torch.no_grad():
        step_logits, past = PrefillStep(model)(ids, mask, positions)
        for step in range(new_tokens):
            last = step_logits[:, -1]
            tokens.append(last.argmax(-1, keepdim=True))
            logits.append(last)
            if step + 1 == new_tokens:
                break
            mask = torch.cat([mask, torch.ones_like(tokens[-1])], dim=1)
            positions = positions[:, -1:] + 1
            step_logits, past = DecodeStep(model)(tokens[-1], mask, positions, past)
    return torch.cat(tokens, dim=1), torch.stack(logits)


def run(runner: Path, prefill: str, decode: str, prompt: Path, new_tokens: int, out: Path):
    return subprocess.run(
        [str(runner), prefill, decode, str(prompt), str(new_tokens), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_python_free_packages_generate_from_cpp(runner: Path, tmp_path: Path) -> None:
    """DeepSeek-V2 (complex RoPE, experts built the default way) in float32: 8 greedy tokens of
    a left-padded batch of 2 from C++ equal eager PyTorch's, logits within float32 rounding."""
    model = float32_model("deepseek_v2")
    prefill = export.aoti.compile_package(
        export.export_prefill_step(model, max_seq_len=64), tmp_path / "prefill.pt2",
        python_free=True,
    )  # fmt: skip
    decode = export.aoti.compile_package(
        export.export_decode_step(model, max_cache_len=64), tmp_path / "decode.pt2",
        python_free=True,
    )  # fmt: skip
    ids, mask, positions = prompt_inputs(model, 2, 9, seed=3)
    torch.save([ids, mask, positions], tmp_path / "prompt.pt")
    done = run(runner, prefill, decode, tmp_path / "prompt.pt", 8, tmp_path / "out.pt")
    assert done.returncode == 0, done.stderr[-3000:]
    got_tokens, got_logits = torch.load(tmp_path / "out.pt")
    want_tokens, want_logits = eager_greedy(model, ids, mask, positions, 8)
    assert torch.equal(got_tokens, want_tokens)
    assert relative_error(got_logits, want_logits) <= 1e-5


class OneAttention(torch.nn.Module):
    """A program that is one ``mla::attention`` call over a dense latent cache."""

    def forward(self, q, kv_c, k_pe, cache_seqlens):
        out, _ = mla_ops.mla_decode(
            q, (kv_c, k_pe), cache_seqlens, head_dim_v=kv_c.shape[-1], softmax_scale=0.125
        )
        return out


def test_a_package_that_calls_back_into_python_names_the_op(runner: Path, tmp_path) -> None:
    """The same runner on a default package (the ``mla`` op called back through the dispatcher)
    fails to load, naming ``mla::attention``."""
    args = (torch.randn(2, 1, 4, 40), torch.randn(2, 12, 32), torch.randn(2, 12, 8),
            torch.tensor([12, 5], dtype=torch.int32))  # fmt: skip
    with torch.no_grad():
        program = torch.export.export(OneAttention(), args)
    callback = export.aoti.compile_package(program, tmp_path / "callback.pt2")
    torch.save(list(args[:1]), tmp_path / "prompt.pt")
    done = run(runner, callback, callback, tmp_path / "prompt.pt", 1, tmp_path / "out.pt")
    assert done.returncode != 0 and "mla::attention" in done.stderr, done.stderr[-3000:]
