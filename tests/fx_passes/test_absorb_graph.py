"""absorb_mla on hand-written MLA attention: every key/attention form, negative cases, export.

Each module below writes the naive MLA math a different way; the rewrite must find it by
structure, produce the same output (float64, 1e-10) and leave non-MLA or unsafe sites alone.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from mla_compile import fx_passes
from mla_compile.fx_passes import RewriteOptions, absorb_mla, mla_backend

B, H, S, T, L, R, P, V, D = 2, 3, 1, 9, 32, 16, 16, 8, 40


class NaiveMLA(torch.nn.Module):
    """The expanded-K/V MLA attention over a latent cache, in several spellings."""

    def __init__(self, key_form="cat", attention="sdpa", reuse_kv=False, bias=False):
        super().__init__()
        self.key_form, self.attention, self.reuse_kv = key_form, attention, reuse_kv
        self.kv_b_proj = torch.nn.Linear(L, H * (P + V), bias=bias)
        self.o_proj = torch.nn.Linear(H * V, D, bias=False)

    def forward(self, query, latent, k_rot, mask):
        # query [B, H, S, P+R], latent [B, 1, T, L], k_rot [B, 1, T, R], mask [B, 1, S, T]
        batch, _, t, _ = latent.shape
        kv = self.kv_b_proj(latent).view(batch, t, -1, P + V).transpose(1, 2)  # [B, H, T, P+V]
        k_nope, value = torch.split(kv, [P, V], dim=-1)
        k_rot = k_rot.expand(-1, H, -1, -1)
        if self.key_form == "cat":
            key = torch.cat([k_nope, k_rot], dim=-1)
        elif self.key_form == "new_empty":  # Hugging Face's expand_kv
            key = kv.new_empty(*kv.shape[:-1], P + R)
            key[..., :P].copy_(k_nope)
            key[..., P:].copy_(k_rot)
        else:  # DeepSeek's original remote code: slice assignment
            key = kv.new_empty(*kv.shape[:-1], P + R)
            key[:, :, :, :P] = k_nope
            key[:, :, :, P:] = k_rot
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3)
        else:
            weights = torch.matmul(query, key.transpose(2, 3)) * 0.3
            weights = weights + mask
            weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
            weights = F.dropout(weights, p=0.0, training=False)
            out = torch.matmul(weights, value)
        out = self.o_proj(out.transpose(1, 2).reshape(batch, query.shape[2], H * V))
        return (out, kv) if self.reuse_kv else out


class PlainMHA(torch.nn.Module):
    """Ordinary multi-head attention: no latent projection, nothing to rewrite."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def inputs(mask_kind="bool", q_len=S, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H, q_len, P + R, generator=gen, dtype=dtype)
    latent = torch.randn(B, 1, T, L, generator=gen, dtype=dtype)
    k_rot = torch.randn(B, 1, T, R, generator=gen, dtype=dtype)
    visible = torch.ones(B, 1, q_len, T, dtype=torch.bool)
    visible[1, :, :, :3] = False  # left padding of sequence 1
    if mask_kind == "bool":
        mask = visible
    else:
        # Hugging Face's fill for hidden keys (float32's min: the eager softmax runs in float32)
        mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min).to(dtype)
    return query, latent, k_rot, mask


class Captured:
    """The dynamo graph of a module (torch-level calls) and the inputs dynamo passes it."""

    def __init__(self, model, args):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append((gm, example_inputs))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(model, backend=backend, fullgraph=True)(*args)
        assert len(graphs) == 1
        self.gm, self.graph_inputs = graphs[0]

    def run(self):
        """The graph's outputs on the captured inputs (parameters are graph inputs)."""
        return self.gm(*self.graph_inputs)


def capture(model, args) -> Captured:
    return Captured(model, args)


def node_targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("key_form", ["cat", "new_empty", "setitem"])
def test_rewrites_every_spelling(key_form: str, attention: str) -> None:
    model = NaiveMLA(key_form, attention).double()
    args = inputs("bool" if attention == "sdpa" else "float")
    # The eager spelling runs its softmax in float32 (as Hugging Face's does, even for float64
    # models): the float64 truth is the same math through SDPA.
    exact = NaiveMLA(key_form, "sdpa").double()
    exact.load_state_dict(model.state_dict())
    expected = exact(*args)
    assert (model(*args) - expected).abs().max() < 1e-6
    captured = capture(model, args)
    gm = captured.gm
    report = absorb_mla(gm)
    assert report.rewritten == 1, str(report)
    targets = " ".join(node_targets(gm))
    assert "absorbed_mla_attention" in targets
    assert "scaled_dot_product_attention" not in targets and "softmax" not in targets
    assert sum("linear" in t for t in node_targets(gm)) == 1  # o_proj stays, kv_b_proj is gone
    torch.testing.assert_close(captured.run()[0], expected, rtol=1e-10, atol=1e-12)


def test_counter_and_log(caplog) -> None:
    counters.clear()
    model = NaiveMLA().double()
    args = inputs()
    with caplog.at_level(logging.INFO, logger="mla_compile.fx_passes"):
        torch._dynamo.reset()
        out = torch.compile(model, backend="mla_eager", fullgraph=True)(*args)
    assert counters["mla"]["absorbed_sites"] == 1
    assert "found MLA site" in caplog.text and "rewrote sdpa attention" in caplog.text
    torch.testing.assert_close(out, model(*args), rtol=1e-10, atol=1e-12)


def test_silent_by_default(capsys) -> None:
    torch._dynamo.reset()
    torch.compile(NaiveMLA().double(), backend="mla_eager", fullgraph=True)(*inputs())
    captured = capsys.readouterr()
    assert "fx_passes" not in captured.err + captured.out


def test_reused_kv_projection_is_skipped(caplog) -> None:
    model = NaiveMLA(reuse_kv=True).double()
    args = inputs()
    captured = capture(model, args)
    with caplog.at_level(logging.INFO, logger="mla_compile.fx_passes"):
        report = absorb_mla(captured.gm)
    assert report.rewritten == 0
    assert len(report.skipped) == 1
    assert "kv_b_proj output also used elsewhere" in report.skipped[0].reason
    assert "kv_b_proj output also used elsewhere" in caplog.text
    for got, want in zip(captured.run(), model(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bias_on_kv_b_proj_is_skipped() -> None:
    report = absorb_mla(capture(NaiveMLA(bias=True).double(), inputs()).gm)
    assert report.rewritten == 0 and "bias" in report.skipped[0].reason


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_prefill_is_chunked_over_the_latent(chunk_tokens: int) -> None:
    """A prefill-length site becomes ``mla::prefill`` (the un-absorbed form a chunk of keys at a
    time) and stays exact; with ``prefill="original"`` it is left as written."""
    model = NaiveMLA().double()
    args = inputs(q_len=T)
    captured = capture(model, args)
    counters.clear()
    options = RewriteOptions(prefill_chunk_tokens=chunk_tokens, prefill_original_bytes=0)
    report = absorb_mla(captured.gm, options=options)
    assert report.rewritten == 0 and not report.skipped and not report.kept
    assert "prefill (S_q=9 > max_q_len=8)" in report.prefill[0].reason
    assert counters["mla"]["prefill_sites"] == 1 and counters["mla"]["kept_sites"] == 0
    targets = " ".join(node_targets(captured.gm))
    assert "chunked_mla_prefill" in targets and "scaled_dot_product" not in targets
    torch.testing.assert_close(captured.run()[0], model(*args), rtol=1e-10, atol=1e-12)

    captured = capture(model, args)
    report = absorb_mla(captured.gm, options=RewriteOptions(prefill="original"))
    assert report.rewritten == 0 and not report.prefill and not report.skipped
    assert "prefill (S_q=9 > max_q_len=8)" in report.kept[0].reason
    assert "chunked_mla_prefill" not in " ".join(node_targets(captured.gm))
    # and with a larger limit the same graph is absorbed and still exact (S_q > 1, masked)
    captured = capture(model, args)
    assert absorb_mla(captured.gm, max_q_len=16).rewritten == 1
    torch.testing.assert_close(captured.run()[0], model(*args), rtol=1e-10, atol=1e-12)


def test_rewrite_options_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="prefill must be one of"):
        RewriteOptions(prefill="absorbed")
    with pytest.raises(ValueError, match="max_q_len must be an int >= 0"):
        RewriteOptions(max_q_len=-1)
    with pytest.raises(ValueError, match="prefill_original_bytes must be an int >= 0"):
        RewriteOptions(prefill_original_bytes=-1)
    with pytest.raises(TypeError, match="rewrite must be a RewriteOptions"):
        mla_backend({"prefill": "original"})


def test_plain_attention_is_not_touched() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    gm = capture(PlainMHA(), (q, k, v)).gm
    before = gm.code
    report = absorb_mla(gm)
    assert report.rewritten == 0 and not report.sites
    assert gm.code == before


def test_weight_update_is_seen() -> None:
    """W_UK / W_UV are views of the live kv_b_proj weight, not copies taken at compile time."""
    model = NaiveMLA().double()
    args = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="mla_eager", fullgraph=True)
    compiled(*args)
    with torch.no_grad():
        model.kv_b_proj.weight.mul_(1.5)
    torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_exported_program_module(attention: str) -> None:
    """The same rewrite on an ATen-level graph (torch.export), run without Inductor."""
    model = NaiveMLA("new_empty", attention).double()
    args = inputs("bool" if attention == "sdpa" else "float")
    exact = NaiveMLA("new_empty", "sdpa").double()  # float64 truth (see above)
    exact.load_state_dict(model.state_dict())
    gm = torch.export.export(model, args).module()
    report = absorb_mla(gm)
    assert report.rewritten == 1, str(report)
    torch.testing.assert_close(gm(*args), exact(*args), rtol=1e-10, atol=1e-12)


def test_float32_tolerance() -> None:
    model = NaiveMLA().float()
    args = inputs(dtype=torch.float32)
    expected = NaiveMLA().double()
    expected.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    out = torch.compile(model, backend="mla_eager", fullgraph=True)(*args)
    ref = expected(*(a.double() if a.is_floating_point() else a for a in args))
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-4


def test_backend_names_are_registered_by_entry_point() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names.get("mla") == "mla_compile.fx_passes.backend:mla"
    assert names.get("mla_eager") == "mla_compile.fx_passes.backend:mla_eager"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("mla") is fx_passes.mla


def test_mla_eager_rejects_inductor_options() -> None:
    # dynamo wraps the backend's ValueError in BackendCompilerFailed
    with pytest.raises(Exception, match="backend 'mla_eager' takes no mode or options"):
        torch._dynamo.reset()
        torch.compile(NaiveMLA().double(), backend="mla_eager", mode="max-autotune")(*inputs())


class MutatingMLA(NaiveMLA):
    """MLA attention whose inputs are written in place after the original reads them (the latent
    after kv_b_proj, the rope key after the key is built) and before the attention."""

    def __init__(self, mutated: str, key_form: str = "cat") -> None:
        super().__init__(key_form, "sdpa")
        self.mutated = mutated

    def forward(self, query, latent, k_rot, mask):
        batch, _, t, _ = latent.shape
        kv = self.kv_b_proj(latent).view(batch, t, -1, P + V).transpose(1, 2)
        if self.mutated == "latent":
            latent.mul_(2.0)  # after kv_b_proj read it
        k_nope, value = torch.split(kv, [P, V], dim=-1)
        key = torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], dim=-1)
        if self.mutated == "k_rot":
            k_rot[..., :4] = 0.0  # after the key copied it, through a view
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3)
        return self.o_proj(out.transpose(1, 2).reshape(batch, query.shape[2], H * V))


@pytest.mark.parametrize("mutated", ["latent", "k_rot"])
def test_inputs_written_after_they_are_read_keep_the_site(mutated: str) -> None:
    """The absorbed form would read the latent and the rope key at the attention, after the
    write: the site is left as it is (with the reason), and the compiled model equals eager."""
    model = MutatingMLA(mutated).double()
    args = inputs()
    expected = model(*[a.clone() for a in args])
    captured = capture(model, [a.clone() for a in args])
    counters.clear()
    report = absorb_mla(captured.gm)
    assert report.rewritten == 0 and counters["mla"]["skipped_sites"] == 1, str(report)
    assert "modified in place" in str(report) and "before the attention" in str(report)
    torch._dynamo.reset()
    twin = MutatingMLA(mutated).double()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(twin, backend="mla_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*[a.clone() for a in args]), expected, rtol=0, atol=1e-12)


def test_a_write_before_the_read_is_still_rewritten() -> None:
    """An in-place write that both forms see (before kv_b_proj reads the latent) is no reason
    to skip."""

    class WritesFirst(NaiveMLA):
        def forward(self, query, latent, k_rot, mask):
            latent.mul_(0.5)
            return super().forward(query, latent, k_rot, mask)

    model = WritesFirst().double()
    args = inputs()
    captured = capture(model, [a.clone() for a in args])
    report = absorb_mla(captured.gm)
    assert report.rewritten == 1, str(report)
