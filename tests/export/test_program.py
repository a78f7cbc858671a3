"""torch.export of rewritten decode / prefill steps: graph contents, numbers, save and load."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils import _pytree as pytree

from mla_compile import export
from mla_compile.export import decode_inputs, prompt_inputs
from mla_compile.fx_passes import absorb_mla
from tests.export.helpers import (
    EXPORT_FAMILIES,
    SHAPES,
    cached_values_per_token,
    decode_dims,
    eager_decode,
    eager_prefill,
    float32_model,
    plain_decode_export,
    relative_error,
)
from tests.fx_passes.tiny_models import llama_model


@pytest.fixture(scope="module", params=EXPORT_FAMILIES)
def decode_program(request):
    model = float32_model(request.param)
    return model, export.export_decode_step(model)


def test_decode_program_has_mla_ops_and_no_expanded_kv(decode_program) -> None:
    model, program = decode_program
    program.validate()
    layers = model.config.num_hidden_layers
    assert export.mla_op_counts(program) == {
        "mla.attention.default": layers,
        "mla.decode.default": 0,
        "mla.combine.default": 0,
    }
    config = model.config
    latent_width = max(config.kv_lora_rank, config.qk_rope_head_dim)
    widths = cached_values_per_token(program)
    assert widths, "the cache length must appear in the graph"
    # Every tensor over the cached tokens is a latent one (L or R values per token): no K/V
    # expanded to H heads. The same check on the unrewritten export finds H x (P+R) per token.
    assert max(widths.values()) <= latent_width, {
        k: v for k, v in widths.items() if v > latent_width
    }


def test_unrewritten_export_has_expanded_kv() -> None:
    """The negative control of the test above: the check sees expanded K/V when they exist."""
    model = float32_model("deepseek_v3")
    args = decode_inputs(model, 2, 16)
    program = plain_decode_export(model, args)
    config = model.config
    expanded = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert max(cached_values_per_token(program).values()) == expanded
    assert set(export.mla_op_counts(program).values()) == {0}


@pytest.mark.parametrize("batch, cache_len", SHAPES)
def test_decode_program_matches_eager(decode_program, batch: int, cache_len: int) -> None:
    model, program = decode_program
    args = decode_inputs(model, batch, cache_len, seed=batch)
    want_logits, want_present = eager_decode(model, args)
    with torch.no_grad():
        logits, present = program.module()(*args)
    assert relative_error(logits, want_logits) <= 1e-4
    for (keys, values), (want_keys, want_values) in zip(present, want_present):
        assert keys.shape == want_keys.shape and values.shape == want_values.shape
        assert relative_error(keys, want_keys) <= 1e-5
        assert relative_error(values, want_values) <= 1e-5


def test_save_load_round_trip(decode_program, tmp_path) -> None:
    model, program = decode_program
    path = tmp_path / "decode.pt2"
    export.save_program(program, path)
    assert export.program.mla_ops_in_archive(path) == {"mla.attention.default"}
    loaded = export.load_program(path)
    loaded.validate()
    args = decode_inputs(model, 3, 9, seed=5)
    with torch.no_grad():
        want = program.module()(*args)[0]
        got = loaded.module()(*args)[0]
    assert torch.equal(got, want)


def test_load_names_missing_ops(decode_program, tmp_path) -> None:
    """An archive calling an mla op this process lacks fails before deserialising, by name."""
    _, program = decode_program
    path = tmp_path / "decode.pt2"
    export.save_program(program, path)
    renamed = tmp_path / "future.pt2"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(renamed, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename.endswith(".json"):
                data = data.replace(b"torch.ops.mla.attention", b"torch.ops.mla.attention_v9")
            target.writestr(item, data)
    match = r"mla\.attention_v9\.default.*import mla_compile\.mla_ops"
    with pytest.raises(RuntimeError, match=match):
        export.load_program(renamed)


def test_fresh_process_needs_the_registration(decode_program, tmp_path) -> None:
    """A process that never imports mla_ops cannot deserialise the program (torch's error);
    export.load_program in the same process registers the ops and loads it."""
    _, program = decode_program
    path = tmp_path / "decode.pt2"
    export.save_program(program, path)
    script = (
        "import torch, sys\n"
        f"path = {str(path)!r}\n"
        "try:\n"
        "    torch.export.load(path)\n"
        "    sys.exit('loaded without the registration')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "from mla_compile import export\n"
        "print(export.mla_op_counts(export.load_program(path)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'mla.attention.default': 2" in done.stdout


def test_absorb_mla_on_exported_program() -> None:
    """absorb_mla(ExportedProgram) -> report.program: validated, dynamic dims and ranges kept,
    exportable again."""
    model = float32_model("deepseek_v2")
    args = decode_inputs(model, 2, 12)
    program = plain_decode_export(model, args)
    with torch.no_grad():
        counters.clear()
        report = absorb_mla(program)
    assert report.rewritten == 2 and counters["mla"]["absorbed_sites"] == 2
    assert export.mla_op_counts(program)["mla.attention.default"] == 0  # the input is unchanged
    new = report.program
    new.validate()
    assert export.mla_op_counts(new)["mla.attention.default"] == 2
    assert {str(k): (int(v.lower), int(v.upper)) for k, v in new.range_constraints.items()} == {
        str(k): (int(v.lower), int(v.upper)) for k, v in program.range_constraints.items()
    }
    with torch.no_grad():
        again = torch.export.export(new.module(), args, dynamic_shapes=decode_dims(args))
        other = decode_inputs(model, 4, 30, seed=3)
        want = eager_decode(model, other)[0]
        assert relative_error(again.module()(*other)[0], want) <= 1e-4


def test_program_without_mla_is_unchanged() -> None:
    """A Llama decode step: nothing found, the same program object back, same outputs."""
    model = llama_model(torch.float32)
    args = decode_inputs(model, 2, 8)
    with torch.no_grad():
        program = torch.export.export(export.DecodeStep(model), args)
        before = [(n.name, str(n.target)) for n in program.graph.nodes]
        counters.clear()
        report = absorb_mla(program)
    assert report.program is program and report.rewritten == 0 and not report.sites
    assert [(n.name, str(n.target)) for n in program.graph.nodes] == before
    assert counters["mla"]["absorbed_sites"] == 0
    with pytest.raises(ValueError, match="has no kv_lora_rank"):
        export.export_decode_step(model)


def test_prefill_program_feeds_decode_program(decode_program) -> None:
    """Prompt pass and decode step, both exported (dynamic batch / lengths), chained as a
    deployment would, match the eager model."""
    model, decode = decode_program
    prefill = export.export_prefill_step(model)
    assert set(export.mla_op_counts(prefill).values()) == {0}  # prefill keeps its form
    for batch, seq_len in [(3, 5), (2, 21)]:
        ids, mask, positions = prompt_inputs(model, batch, seq_len + 1, seed=seq_len)
        prompt = (ids[:, :seq_len], mask[:, :seq_len], positions[:, :seq_len])
        want_logits, want_present = eager_prefill(model, prompt)
        with torch.no_grad():
            logits, present = prefill.module()(*prompt)
            step = (ids[:, seq_len:], mask, positions[:, seq_len:], present)
            next_logits = decode.module()(*step)[0]
        assert relative_error(logits, want_logits) <= 1e-4
        for got, want in zip(pytree.tree_leaves(present), pytree.tree_leaves(want_present)):
            assert relative_error(got, want) <= 1e-5
        assert relative_error(next_logits, eager_decode(model, step)[0]) <= 1e-4


def test_export_errors() -> None:
    model = float32_model("deepseek_v3")
    with pytest.raises(ValueError, match="batch_size must be an int >= 2"):
        export.export_decode_step(model, batch_size=1)
    with pytest.raises(ValueError, match="q_len must be an int in"):
        export.export_decode_step(model, q_len=9)
    with pytest.raises(ValueError, match="leaves no room"):
        export.export_decode_step(model, cache_len=64, max_cache_len=32)
    with pytest.raises(TypeError, match=r"GraphModule or a torch\.export\.ExportedProgram"):
        absorb_mla(model)
