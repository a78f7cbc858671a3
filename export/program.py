"""``torch.export`` of a Hugging Face MLA model's decode and prefill steps, rewritten; save/load.

The decode program is exported with a dynamic batch and cache length, rewritten by
``fx_passes.absorb_mla`` (latent attention through ``mla.attention``, no expanded
K/V) and exported again, so the result is an ordinary, validated ``ExportedProgram``.
"""

from __future__ import annotations

import os
import re
import zipfile

import sympy
import torch

from mla_compile.fx_passes import absorb_mla
from mla_compile.fx_passes.absorb import DEFAULT_MAX_Q_LEN

from .archive import MAX_MEMBER_BYTES, check_program_archive
from .steps import DecodeStep, PrefillStep, decode_inputs, prompt_inputs

# mla.attention is what the rewrite emits; decode and combine appear where a graph calls them.
MLA_OPS = ("mla.attention.default", "mla.decode.default", "mla.combine.default")
_REGISTRATION_HINT = (
    "The program calls the mla custom ops (torch.ops.mla.attention, ...), which exist in a "
    "process only after `import mla_compile.mla_ops` (pip install mla-compile): import it "
    "before loading, or load with mla_compile.export.load_program, which does."
)


def mla_op_counts(program: torch.export.ExportedProgram | torch.fx.GraphModule) -> dict[str, int]:
    """How many ``mla.attention`` / ``mla.decode`` / ``mla.combine`` nodes the program's graph
    holds."""
    graph = program.graph
    counts = dict.fromkeys(MLA_OPS, 0)
    for node in graph.nodes:
        if str(node.target) in counts:
            counts[str(node.target)] += 1
    return counts


def _check_step_args(batch_size: int, length: int, length_name: str, q_len: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 2:
        # export specialises a dimension whose example size is 0 or 1
        raise ValueError(f"batch_size must be an int >= 2 (the example batch), got {batch_size!r}")
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"{length_name} must be an int >= 2, got {length!r}")
    if not isinstance(q_len, int) or not 1 <= q_len <= DEFAULT_MAX_Q_LEN:
        raise ValueError(f"q_len must be an int in [1, {DEFAULT_MAX_Q_LEN}], got {q_len!r}")


def export_decode_step(
    model: torch.nn.Module,
    *,
    batch_size: int = 2,
    cache_len: int = 16,
    q_len: int = 1,
    max_batch_size: int = 1024,
    max_cache_len: int | None = None,
) -> torch.export.ExportedProgram:
    """Export one decode step of ``model`` (a Hugging Face MLA ``*ForCausalLM``), rewritten.

    The program is ``DecodeStep(model)``: ``(input_ids [B, q_len], attention_mask [B, T+q_len],
    position_ids [B, q_len], past) -> (logits, present)`` with ``B`` in ``[1, max_batch_size]`` and
    the cache length ``T`` in ``[1, max_cache_len - q_len]`` (default: the model's
    ``max_position_embeddings``). ``batch_size`` and ``cache_len`` only size the example inputs.
    Every MLA site is rewritten (an ``mla.attention`` node); a model where none is found
    raises ``ValueError`` with ``absorb_mla``'s report.
    """
    _check_step_args(batch_size, cache_len, "cache_len", q_len)
    if getattr(model.config, "kv_lora_rank", None) is None:
        raise ValueError(
            f"export_decode_step exports MLA models; {type(model).__name__} has no kv_lora_rank "
            "in its config (use torch.export.export for other models)"
        )
    if max_cache_len is None:
        max_cache_len = int(model.config.max_position_embeddings)
    if max_cache_len - q_len < cache_len:
        raise ValueError(f"max_cache_len={max_cache_len} leaves no room for cache_len={cache_len}")
    step = DecodeStep(model).eval()
    args = decode_inputs(model, batch_size, cache_len, q_len)
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    past_len = torch.export.Dim("cache_len", min=1, max=max_cache_len - q_len)
    cache_dims = {0: batch, 2: past_len}
    dynamic_shapes = (
        {0: batch},
        {0: batch, 1: past_len + q_len},
        {0: batch},
        tuple((cache_dims, cache_dims) for _ in args[3]),
    )
    with torch.no_grad():
        program = torch.export.export(step, args, dynamic_shapes=dynamic_shapes)
        report = absorb_mla(program)
    if not report.rewritten:
        raise ValueError(f"no MLA attention was rewritten in the decode step:\n{report}")
    return report.program


def export_prefill_step(
    model: torch.nn.Module,
    *,
    batch_size: int = 2,
    seq_len: int = 16,
    max_batch_size: int = 1024,
    max_seq_len: int | None = None,
) -> torch.export.ExportedProgram:
    """Export the prompt pass of ``model``: ``PrefillStep(model)``, ``(input_ids [B, S],
    attention_mask [B, S], position_ids [B, S]) -> (logits, present)`` with dynamic ``B`` and
    ``S`` in ``[2, max_seq_len]``. The prompt pass keeps the model's own attention (standard
    ops, which every export target takes; ``backend="mla"`` computes it with ``mla::prefill``);
    ``present`` is the cache the decode program takes as ``past``."""
    _check_step_args(batch_size, seq_len, "seq_len", 1)
    if max_seq_len is None:
        max_seq_len = int(model.config.max_position_embeddings)
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    seq = torch.export.Dim("seq_len", min=2, max=max_seq_len)
    args = prompt_inputs(model, batch_size, seq_len)
    with torch.no_grad():
        return torch.export.export(
            PrefillStep(model).eval(), args, dynamic_shapes=({0: batch, 1: seq},) * 3
        )


def save_program(program: torch.export.ExportedProgram, path: str | os.PathLike) -> None:
    """``torch.export.save``; the file needs ``import mla_compile.mla_ops`` in the loading
    process."""
    torch.export.save(program, path)


def load_program(
    path: str | os.PathLike, *, max_member_bytes: int = MAX_MEMBER_BYTES
) -> torch.export.ExportedProgram:
    """``torch.export.load`` of a file from outside, after checking it and registering the ``mla``
    ops (``import mla_compile.mla_ops``).

    Before anything in the file is deserialised, the archive is checked
    (``export.archive.check_program_archive``: no pickled tensors or objects, sample inputs that
    the restricted unpickler reads, no member past ``max_member_bytes`` bytes, no unsafe names;
    ``UnsafeArchiveError`` names the member) and its graph is scanned for ``torch.ops.mla.*``
    targets: one this process does not define gets a message naming it. The file is opened once,
    so the bytes checked are the bytes loaded.
    """
    try:
        from mla_compile import mla_ops  # noqa: F401  (registers torch.ops.mla.*)
    except ImportError as error:
        raise ImportError(_REGISTRATION_HINT) from error
    shown = os.fspath(path)
    with open(path, "rb") as file:
        archive = check_program_archive(file, shown, max_member_bytes)
        targets = _op_targets(archive)
        if any(op.startswith("transformers.") for op in targets):
            register_transformers_ops()
        missing = [op for op in sorted(targets) if op.startswith("mla.") and not _resolves(op)]
        if missing:
            raise RuntimeError(
                f"{shown} calls {', '.join(missing)}, which this process does not define "
                "(is it from a newer mla-compile?). " + _REGISTRATION_HINT
            )
        file.seek(0)
        program = torch.export.load(file)
    _drop_expression_ranges(program)
    return program


def _drop_expression_ranges(program: torch.export.ExportedProgram) -> None:
    """A deserialised program's shape environment ranges its range constraints' expressions
    (``s17 + 1``) beside its symbols, which ``run_decompositions`` (ONNX export, AOTInductor)
    refuses ("expected sympy.Symbol"); a freshly exported program ranges symbols only. The
    expressions' ranges follow from their symbols', so dropping them loses nothing."""
    from torch._export.utils import _get_shape_env_from_gm

    shape_env = _get_shape_env_from_gm(program.graph_module)
    if shape_env is None:
        return
    for key in [k for k in shape_env.var_to_range if not isinstance(k, sympy.Symbol)]:
        del shape_env.var_to_range[key]


def mla_ops_in_archive(
    path: str | os.PathLike, *, max_member_bytes: int = MAX_MEMBER_BYTES
) -> set[str]:
    """The ``mla.<op>.<overload>`` targets named by the programs of a ``.pt2`` archive (its
    members checked first, as ``load_program`` does)."""
    shown = os.fspath(path)
    with open(path, "rb") as file:
        archive = check_program_archive(file, shown, max_member_bytes)
        return {op for op in _op_targets(archive) if op.startswith("mla.")}


def _op_targets(archive: zipfile.ZipFile) -> set[str]:
    """The ``mla.*`` and ``transformers.*`` op targets (``<namespace>.<op>.<overload>``) the
    archive's graphs name, in one pass over its JSON members (sizes already bounded by
    ``check_program_archive``)."""
    found: set[str] = set()
    for name in archive.namelist():
        if name.endswith(".json"):
            text = archive.read(name).decode("utf-8", errors="replace")
            found.update(match.group(1) for match in _OP_TARGET.finditer(text))
    return found


_OP_TARGET = re.compile(r"torch\.ops\.((?:mla|transformers)\.\w+\.\w+)")


def register_transformers_ops() -> None:
    """Register the custom ops transformers' own layers put into a traced graph (the experts'
    ``transformers::grouped_mm_fallback`` of a model built the default way), which transformers
    defines when its integration module is imported: a program exported from such a model
    calls them. Needs transformers installed (the ``[hf]`` extra)."""
    try:
        import transformers.integrations.moe  # noqa: F401  (defines torch.ops.transformers.*)
    except ImportError as error:
        raise ImportError(
            "this program calls transformers' own ops (torch.ops.transformers.*, the experts of "
            "a model built the default way): install transformers in the loading process "
            "(pip install 'mla-compile[hf]')"
        ) from error


def _resolves(target: str) -> bool:
    _, op, overload = target.split(".")
    packet = getattr(torch.ops.mla, op, None)
    return packet is not None and overload in packet.overloads()


def registration_hint() -> str:
    """What a process needs before it runs a program that calls the ``mla`` ops."""
    return _REGISTRATION_HINT
