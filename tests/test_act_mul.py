"""The fused silu(gate) * up of the executor's MLP units (base_executor/kernels/act_mul.py)
against its slow twin, torch's two ops: bitwise, over dtypes, widths and token counts (GPU,
marker `gpu`); and the runner's choice between them (CPU)."""
from __future__ import annotations

import pytest
import torch

from symbiont.base_executor import runner
from symbiont.base_executor.catalog import UnitTable
from symbiont.base_executor.models import build_builtin
from symbiont.proto import executor_pb2 as pb

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [64, 1000, 8192, 14336])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_silu_mul_is_bitwise_torchs_two_ops(dtype, width, tokens):
    from symbiont.base_executor.kernels.act_mul import act_mul_ref, silu_mul

    gen = torch.Generator().manual_seed(width + tokens)
    gate_up = (8 * torch.randn(tokens, 2 * width, generator=gen)).to(dtype).cuda()
    tiny = torch.finfo(dtype).tiny
    edge = torch.tensor([0.0, -0.0, 100.0, -100.0, tiny / 2, -tiny / 2, tiny, -tiny])  # (exp overflows; subnormals)
    gate_up[0, :8] = edge.to(dtype)
    gate_up[0, width:width + 8] = edge.flip(0).to(dtype)
    got = silu_mul(gate_up)
    assert got.shape == (tokens, width) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, act_mul_ref(torch.nn.SiLU(), gate_up))
    strided = torch.empty(tokens, 2 * width + 64, dtype=dtype, device="cuda")[:, 32:32 + 2 * width]
    strided.copy_(gate_up)  # (rows apart by more than their width)
    assert torch.equal(silu_mul(strided), got)


@gpu
def test_silu_mul_refuses_what_it_cannot_run():
    from symbiont.base_executor.kernels.act_mul import silu_mul

    with pytest.raises(ValueError, match="2 \\* width"):
        silu_mul(torch.zeros(3, 5, device="cuda"))
    with pytest.raises(ValueError, match="contiguous columns"):
        silu_mul(torch.zeros(8, 3, device="cuda").t())
    with pytest.raises(TypeError, match="CUDA"):
        silu_mul(torch.zeros(3, 4))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mlp_units_on_a_gpu_fuse_silu_only(dtype):
    """The probe at load picks the fused kernel for SiLU MLPs (Llama) and not for GELU ones
    (Gemma 2); the block's forward stays bitwise the module's, fused or not."""
    for name, fused in (("tiny-llama", True), ("tiny-gemma2", False)):
        model = build_builtin(name).to(dtype)
        block = model.model.layers[0].mlp.cuda()
        table = UnitTable(model).to(torch.device("cuda"))
        unit = table.get("model.layers.0.mlp")
        assert (unit.act_mul is not None) == fused
        for tokens in (3, runner.FUSE_MIN_ELEMENTS // 64 + 1):  # (below and above the threshold)
            x = torch.randn(tokens, 64, dtype=dtype, device="cuda")
            with torch.no_grad():
                assert torch.equal(runner.run(unit, pb.FORWARD, x, exact=True), block(x))


def test_mlp_units_moved_without_fusing_drop_the_fused_op():
    """UnitTable.to(..., fuse_act=False) (`--no-fused-act`) leaves no MLP unit with a fused op, even
    one set before; off a GPU none is set."""
    table = UnitTable(build_builtin("tiny-llama"))
    mlps = [u for u in table.units.values() if u.kind == "mlp"]
    for u in mlps:
        u.act_mul = runner.act_mul_of  # (anything not None)
    table.to(torch.device("cpu"), fuse_act=False)
    assert mlps and all(u.act_mul is None for u in mlps)
    table.to(torch.device("cpu"))
    assert all(u.act_mul is None for u in mlps)


def test_mlp_forward_uses_the_fused_op_from_the_threshold_on():
    """A call fuses from FUSE_MIN_ELEMENTS products on; below, torch's two ops run."""
    table = UnitTable(build_builtin("tiny-llama"))
    unit = table.get("model.layers.0.mlp")
    width = unit.members[0].out_features // 2
    used = []

    def fused(gate_up):  # (torch's ops stand in for the GPU kernel here)
        used.append(gate_up.shape[0])
        gate, up = gate_up.split(width, dim=-1)
        return unit.act(gate) * up

    unit.act_mul = fused
    big = -(-runner.FUSE_MIN_ELEMENTS // width)
    for tokens in (1, big - 1, big):
        x = torch.randn(tokens, 64)
        unfused = unit.act_mul
        unit.act_mul = None
        want = runner.run(unit, pb.FORWARD, x)
        unit.act_mul = unfused
        assert torch.equal(runner.run(unit, pb.FORWARD, x), want)
    assert used == [big]
