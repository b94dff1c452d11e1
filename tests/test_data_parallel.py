"""`dlrm.distributed.data_parallel.wrap_dense_parts`: DDP over the dense parts without a per-step buffer broadcast
(their only buffers are constant indices), refusing dense parts with buffers that would need one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dlrm.config import KernelsConfig, ModelConfig
from dlrm.distributed.data_parallel import DenseParts, stateful_buffers, wrap_dense_parts
from dlrm.model.dlrm import build_model


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group (DDP needs a process group), removed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(interaction: str, kernel: str = "torch", pad_multiple: int = 1, device: str = "cpu"):
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction=interaction,
                      top_mlp_input_multiple=pad_multiple)
    return build_model(cfg, [5] * 26, kernels=KernelsConfig(interaction=kernel), device=device)


@pytest.mark.parametrize("interaction,kernel,pad_multiple", [("dot", "torch", 1), ("dot", "triton", 1), ("dcn", "torch", 1),
                                                             ("cat", "torch", 1), ("dcn", "torch", 64)])
def test_no_buffer_broadcast_and_the_same_logits(one_rank, interaction, kernel, pad_multiple):
    """Every dense part's buffer is a declared constant, also inside the padded interaction's wrapper. The Triton
    interaction runs where Triton does: on the GPU where there is one (tests/conftest.py sets TRITON_INTERPRET only
    without CUDA), whose buffers are checked there (the DDP wrapper below is the CPU one)."""
    if kernel == "triton" and torch.cuda.is_available():
        model = _model(interaction, kernel, pad_multiple, device="cuda")
        assert not list(DenseParts(model).named_buffers()) and not stateful_buffers(DenseParts(model))
        return
    model = _model(interaction, kernel, pad_multiple)
    buffers = {n.rsplit(".", 1)[-1] for n, _ in DenseParts(model).named_buffers()}
    assert buffers == (set() if kernel == "triton" else {"tril_rows", "tril_cols"}) and not stateful_buffers(DenseParts(model))
    ddp = wrap_dense_parts(model, torch.device("cpu"))
    assert ddp.broadcast_buffers is False
    dense, embeddings = torch.randn(3, 13), torch.randn(3, 26, 4)
    torch.testing.assert_close(ddp(dense, embeddings), model.forward_from_embeddings(dense, embeddings), rtol=0, atol=0)


def test_a_stateful_buffer_is_refused_by_name(one_rank):
    """A buffer that training changes (a BatchNorm's running mean, say) would need DDP's broadcast: refused, named."""
    model = _model("dot")
    model.over_arch.register_buffer("running_mean", torch.zeros(8))
    with pytest.raises(ValueError, match=r"over_arch\.running_mean"):
        wrap_dense_parts(model, torch.device("cpu"))
