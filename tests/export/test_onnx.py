"""ONNX: the mla ops translated to standard operators (run in onnxruntime) or kept as com.mla
custom nodes; the whole rewritten decode step with dynamic batch and cache length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_compile import export
from mla_compile.export import decode_inputs
from tests.export.helpers import EXPORT_FAMILIES, eager_decode, float32_model, relative_error
from tests.mla_ops.cases import LSE_TOLERANCE, TOLERANCE, make_case

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def run_onnx(path, inputs: list[torch.Tensor]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {arg.name: t.contiguous().numpy() for arg, t in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)


class DecodeAndCombine(torch.nn.Module):
    """The two ops as a module, with the decode partials also returned."""

    def __init__(self, case) -> None:
        super().__init__()
        self.case = case

    def forward(self, q, kv_c, k_pe, cache_seqlens, block_table, attn_mask):
        c = self.case
        out_partial, lse_partial = torch.ops.mla.decode(
            q, kv_c, k_pe, cache_seqlens, block_table, c.softmax_scale, c.causal,
            c.num_splits, None, attn_mask, c.total_splits,
        )  # fmt: skip
        out, lse = torch.ops.mla.combine(out_partial, lse_partial, q.dtype)
        return out_partial, lse_partial, out, lse


# Seeds of make_case drawn to cover: paged (page size 1 and 3) and dense, causal, S_q > 1,
# several splits over long sequences, empty sequences, bool and float masks, 3 heads, chunks of
# one batch-wide length (total_splits).
OP_CASES = [
    dict(seed=1, page_size=1, s_q=3, causal=True, num_splits=2, mask="float"),
    dict(seed=2, page_size=3, heads=3, num_splits=3, max_len=700, mask="bool"),
    dict(seed=3, page_size=None, s_q=2, lengths=[0, 300, 2], causal=True, num_splits=2),
    dict(seed=4, page_size=16, lengths=[700, 0], num_splits=5, mask="bool"),
    dict(seed=5, page_size=None, heads=1, dims=(64, 0), causal=False, mask="float"),
    dict(seed=6, page_size=16, lengths=[1500, 0, 300, 900], num_splits=6, total_splits=4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", OP_CASES, ids=lambda s: f"seed{s['seed']}")
def test_standard_translation_matches_ops(tmp_path, spec: dict, dtype: torch.dtype) -> None:
    """onnxruntime runs the translated ops: partials equal PyTorch's, output and LSE equal the
    independent float64 reference."""
    case = make_case(dtype=dtype, **spec)
    kv_c, k_pe = case.kv_c.contiguous(), case.k_pe.contiguous()
    inputs = [case.q, kv_c, k_pe, case.cache_seqlens, case.block_table, case.attn_mask]
    module = DecodeAndCombine(case)
    want = module(*inputs)
    program = torch.export.export(module, tuple(inputs))
    path = tmp_path / "ops.onnx"
    export.onnx.export_onnx(program, path)
    got = run_onnx(path, [t for t in inputs if t is not None])
    atol, rtol = TOLERANCE[dtype]
    for name, g, w in zip(["out_partial", "lse_partial"], got[:2], want[:2]):
        np.testing.assert_allclose(g, w.numpy(), atol=atol, rtol=rtol, err_msg=name)
    ref_out, ref_lse = case.reference()
    np.testing.assert_allclose(got[2], ref_out.numpy(), atol=atol, rtol=rtol)
    np.testing.assert_allclose(got[3], ref_lse.numpy(), atol=LSE_TOLERANCE[dtype], rtol=1e-5)


@pytest.fixture(scope="module", params=EXPORT_FAMILIES)
def decode_onnx(request, tmp_path_factory):
    model = float32_model(request.param)
    program = export.export_decode_step(model)
    path = tmp_path_factory.mktemp("onnx") / f"{request.param}.onnx"
    export.onnx.export_onnx(program, path)
    return model, program, path


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("cache_len", [5, 37])
def test_decode_step_in_onnxruntime(decode_onnx, batch: int, cache_len: int) -> None:
    """One ONNX file, two batch sizes x two cache lengths, against the eager model."""
    model, _, path = decode_onnx
    args = decode_inputs(model, batch, cache_len, seed=cache_len)
    want_logits, want_present = eager_decode(model, args)
    got = run_onnx(path, torch.utils._pytree.tree_leaves(args))
    assert relative_error(torch.from_numpy(got[0]), want_logits) <= 1e-4
    for g, w in zip(got[1:], torch.utils._pytree.tree_leaves(want_present)):
        assert g.shape == tuple(w.shape)
        assert relative_error(torch.from_numpy(g), w) <= 1e-5


def test_decode_step_onnx_graph(decode_onnx) -> None:
    """Standard operators only, dynamic batch / cache length, the step's input and output names."""
    model, _, path = decode_onnx
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert {node.domain for node in proto.graph.node} <= {"", "ai.onnx"}
    names = [i.name for i in proto.graph.input]
    layers = model.config.num_hidden_layers
    assert names == ["input_ids", "attention_mask", "position_ids"] + [
        f"past.{i}.{kind}" for i in range(layers) for kind in ("key", "value")
    ]
    assert proto.graph.output[0].name == "logits"
    past_dims = proto.graph.input[3].type.tensor_type.shape.dim
    assert past_dims[0].dim_param and past_dims[2].dim_param  # batch and cache length symbolic


def test_custom_domain_translation(decode_onnx, tmp_path) -> None:
    """translation="custom": one com.mla node per op, schemas registered, a checked model."""
    model, program, _ = decode_onnx
    path = tmp_path / "custom.onnx"
    export.onnx.export_onnx(program, path, translation="custom")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    layers = model.config.num_hidden_layers
    custom = [n for n in proto.graph.node if n.domain == export.onnx.CUSTOM_DOMAIN]
    assert sorted(n.op_type for n in custom) == ["Combine"] * layers + ["Decode"] * layers
    assert {(o.domain, o.version) for o in proto.opset_import} >= {("com.mla", 1)}
    decode = next(n for n in custom if n.op_type == "Decode")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in decode.attribute}
    assert attributes["causal"] == 0 and attributes["num_splits"] == 1
    assert attributes["softmax_scale"] == pytest.approx(
        (model.config.qk_nope_head_dim + model.config.qk_rope_head_dim) ** -0.5, rel=1e-6
    )


def test_onnx_errors(tmp_path) -> None:
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(ValueError, match="translation must be one of"):
        export.onnx.export_onnx(program, translation="trt")
    with pytest.raises(TypeError, match="ExportedProgram"):
        export.onnx.export_onnx(torch.nn.Linear(2, 2))
    case = make_case(0, dtype=torch.float32, cache_dtype=torch.float8_e4m3fn, page_size=None)

    class Fp8Decode(torch.nn.Module):
        def forward(self, q, kv_c, k_pe, cache_seqlens):
            return torch.ops.mla.decode(
                q, kv_c, k_pe, cache_seqlens, None, 0.1, False, 1, case.kv_scale, None
            )

    inputs = (case.q, case.kv_c.contiguous(), case.k_pe.contiguous(), case.cache_seqlens)
    fp8 = torch.export.export(Fp8Decode(), inputs)
    with pytest.raises(Exception, match="float8_e4m3fn latent cache is not supported"):
        export.onnx.export_onnx(fp8)
