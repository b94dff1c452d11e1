"""configs/mlperf-dcnv2.json against MLPerf's DLRM-DCNv2 reference.

The reference: mlcommons/training recommendation_v2/torchrec_dlrm/dlrm_main.py (``DLRM_DCN`` from TorchRec's
torchrec/models/dlrm.py, ``LowRankCrossNet`` from torchrec/modules/crossnet.py, MLPs from torchrec/modules/mlp.py),
and training_rules.adoc ("Weight and Bias Initialization": CLOSED division, the reference's distribution).
"""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from dlrm.config import config_from_dict, load_config
from dlrm.data.schema import MLPERF_CARDINALITIES, MLPERF_MULTI_HOT_SIZES
from dlrm.model.archs import InteractionArch
from dlrm.model.dlrm import build_model
from tests.conftest import REPO

MLPERF = REPO / "configs" / "mlperf-dcnv2.json"
# README.MD of the reference, "Run the MLPerf DLRM v2 benchmark": --num_embeddings_per_feature, --multi_hot_sizes
REF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155,
            4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
REF_HOTNESS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def _mlperf_model(seed: int = 0, interaction: str = "dcn"):
    """The MLPerf config's model on the CPU: its MLPs and cross net as they are, small fp32 tables (the layer
    shapes do not depend on the tables; the config's bf16 tables need the Triton embedding)."""
    cfg = load_config(MLPERF)
    cfg.model.embedding_dtype = "fp32"
    cfg.model.interaction = interaction
    torch.manual_seed(seed)
    return cfg, build_model(cfg.model, [min(c, 50) for c in cfg.model.cardinalities])


def _mlp_layers(model):
    return list(model.dense_arch.model.layers), list(model.over_arch.model.layers)


def test_mlperf_config_has_the_reference_shapes_tables_and_hyperparameters():
    raw = json.loads(MLPERF.read_text())
    cfg = config_from_dict(raw)
    m = cfg.model
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (m.interaction, m.cross_layers, m.cross_rank, m.activation) == ("dcn", 3, 512, "relu")
    assert m.cardinalities == REF_ROWS and sum(REF_ROWS) == 204_184_588
    assert m.multi_hot_sizes == REF_HOTNESS and sum(REF_HOTNESS) == 214
    assert (MLPERF_CARDINALITIES, MLPERF_MULTI_HOT_SIZES) == (REF_ROWS, REF_HOTNESS)  # the generator's presets
    assert (m.dropout, m.top_mlp_input_multiple, m.bottom_mlp_input_multiple) == (0.0, 1, 1)
    # dlrm_main.py: --adagrad --learning_rate 0.005 (dense and tables), ADAGRAD_EPS 1e-8, WEIGHT_DECAY 0
    o = cfg.optim
    assert (o.dense.name, o.dense.lr, o.dense.eps, o.dense.weight_decay) == ("adagrad", 0.005, 1e-8, 0.0)
    assert (o.sparse.lr, o.sparse.eps, o.sparse.weight_decay) == (0.005, 1e-8, 0.0)
    assert o.schedule.decay == "none"
    assert (cfg.data.batch_size, cfg.train.epochs) == (65536, 1)


def test_mlperf_model_layer_shapes_and_parameter_count():
    _, model = _mlperf_model()
    bottom, top = _mlp_layers(model)
    assert [tuple(l.weight.shape) for l in bottom] == [(512, 13), (256, 512), (128, 256)]
    assert [tuple(l.weight.shape) for l in top] == [(1024, 3456), (1024, 1024), (512, 1024), (256, 512), (1, 256)]
    assert all(l.bias is not None and l.bias.shape == (l.weight.shape[0],) for l in bottom + top)
    net = model.interaction_arch.crossnet
    assert net.in_features == 27 * 128 == 3456
    assert [tuple(p.shape) for p in net.W_kernels] == [(3456, 512)] * 3
    assert [tuple(p.shape) for p in net.V_kernels] == [(512, 3456)] * 3  # V has no bias
    assert [tuple(p.shape) for p in net.bias] == [(3456,)] * 3
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("sparse_arch"))
    mlps = (13 * 512 + 512) + (512 * 256 + 256) + (256 * 128 + 128) + (3456 * 1024 + 1024) + (1024 * 1024 + 1024) \
        + (1024 * 512 + 512) + (512 * 256 + 256) + (256 + 1)
    assert dense == mlps + 3 * (2 * 3456 * 512 + 3456)


def test_mlperf_forward_is_the_reference_formula_in_float64():
    """InteractionDCNArch: the dense vector first, then the F pooled embeddings, flattened to x0 [B, (F+1) D];
    then x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l (bias after W, none on V), against numpy float64."""
    torch.manual_seed(1)
    arch = InteractionArch(3, 4, "dcn", cross_layers=2, cross_rank=3).double()
    for b in arch.crossnet.bias:
        nn.init.normal_(b)  # zero at init: make the bias count
    dense, sparse = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, 4, dtype=torch.float64)
    x0 = np.concatenate([dense.numpy()[:, None, :], sparse.numpy()], axis=1).reshape(5, -1)
    x = x0
    for W, V, b in zip(arch.crossnet.W_kernels, arch.crossnet.V_kernels, arch.crossnet.bias):
        x = x0 * ((x @ V.detach().numpy().T) @ W.detach().numpy().T + b.detach().numpy()) + x
    np.testing.assert_allclose(arch(dense, sparse).detach().numpy(), x, rtol=1e-12, atol=1e-12)


def test_mlperf_mlps_are_initialised_as_torchrec_dlrm_dcn():
    """TorchRec's MLP layers are plain nn.Linear: weight kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)), bias
    U(+-1/sqrt(fan_in)); MLPerf's closed division must initialise with the reference's distributions. The 2019
    DLRM's N(0, sqrt(2/(fan_in+fan_out))) weights and N(0, sqrt(1/fan_out)) biases gave the logit's bias a
    N(0, 1) start (bound 1/16 in the reference) and the 3456-wide layer twice the reference's weight scale."""
    _, model = _mlperf_model()
    bottom, top = _mlp_layers(model)
    for name, layer in [(f"bottom {i}", l) for i, l in enumerate(bottom)] + [(f"top {i}", l) for i, l in enumerate(top)]:
        fan_out, fan_in = layer.weight.shape
        bound = 1.0 / math.sqrt(fan_in)
        w, b = layer.weight.detach(), layer.bias.detach()
        w_max, b_max = w.abs().max().item(), b.abs().max().item()
        assert w_max <= bound and b_max <= bound, f"{name}: |w| up to {w_max:.4f}, |b| up to {b_max:.4f}, bound {bound:.4f}"
        if w.numel() >= 10_000:  # uniform on +-bound: std bound / sqrt(3)
            assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.05, (name, w.std().item())
    # the cross net and the tables were right already: xavier-normal W and V, zero biases, U(+-sqrt(1/n)) rows
    net = model.interaction_arch.crossnet
    assert abs(net.W_kernels[0].std().item() / math.sqrt(2 / (3456 + 512)) - 1) < 0.05
    assert all(not b.any() for b in net.bias)


def test_dot_model_keeps_the_2019_dlrm_init():
    """The dot interaction is the 2019 DLRM (facebookresearch/dlrm), whose init stays: the logit's bias ~ N(0, 1)."""
    biases = []
    for seed in range(20):
        _, model = _mlperf_model(seed, interaction="dot")
        biases.append(model.over_arch.model.layers[-1].bias.item())
        w = model.over_arch.model.layers[0].weight
        assert abs(w.std().item() / math.sqrt(2 / sum(w.shape)) - 1) < 0.05
    assert max(abs(b) for b in biases) > 1 / 16  # N(0, 1): 20 draws all within 1/16 has probability ~1e-24


@pytest.mark.parametrize("mlp", ["torch", "wgrad", "triton", "fused"])
def test_dcn_init_is_the_same_for_every_mlp_kernel(mlp):
    """Same seed, same weights, whichever layer class runs the MLPs (a checkpoint moves between them)."""
    from dlrm.config import KernelsConfig

    cfg = load_config(MLPERF)
    cfg.model.embedding_dtype = "fp32"
    cards = [min(c, 50) for c in cfg.model.cardinalities]
    # the Triton layer classes run where Triton does: its interpreter on the CPU, the GPU where there is one
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(3)
    ref = build_model(cfg.model, cards, device=device).state_dict()
    torch.manual_seed(3)
    kernels = KernelsConfig(mlp=mlp)
    try:
        other = build_model(cfg.model, cards, kernels=kernels, device=device).state_dict()
    except Exception as e:  # a Triton layer class refused on this machine: nothing to compare
        pytest.fail(f"{mlp}: {e}")
    assert ref.keys() == other.keys()
    for k in ref:
        assert torch.equal(ref[k], other[k]), k
