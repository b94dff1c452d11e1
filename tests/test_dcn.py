"""The DCNv2 interaction (issue #22): `LowRankCrossNet` and ``InteractionArch(kind="dcn")``.

Forward and every gradient (input, each layer's W, V and bias) against a float64 numpy reference
with a hand-derived backward, on odd shapes (B = 1, 3, 127; F = 1; rank 1; one layer),
non-contiguous inputs and gradients; TorchRec's names, shapes and initialisation; the config keys,
their validation, the fast-path choice and the resume policy; configs/kaggle-dcn.json end to end.
"""

import copy
import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, KernelsConfig, ModelConfig, config_from_dict, load_config
from dlrm.model.archs import InteractionArch, LowRankCrossNet
from dlrm.model.dlrm import build_model
from dlrm.train.fast_path import resolve_fast_path
from dlrm.train.profiling import trace_files
from dlrm.train.resume_policy import check_resume_config
from dlrm.train.trainer import train
from tests.conftest import REPO


# ---------------------------------------------------------------------------------------------
# A plain reference: numpy float64, the formula and its hand-derived backward


def reference_forward(x0, Ws, Vs, bs):
    """x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l, row by row; returns the output and what the
    backward needs per layer (x_l, u_l = V_l x_l, p_l = W_l u_l + b_l)."""
    x, saved = x0, []
    for W, V, b in zip(Ws, Vs, bs):
        u = x @ V.T  # [B, r]
        p = u @ W.T + b  # [B, N]
        saved.append((x, u, p))
        x = x0 * p + x
    return x, saved


def reference_backward(g, x0, Ws, Vs, saved):
    """Gradients of sum(g * out) w.r.t. the input and every W_l, V_l, b_l."""
    grad_x0 = np.zeros_like(x0)
    gW, gV, gb = [None] * len(Ws), [None] * len(Ws), [None] * len(Ws)
    for l in reversed(range(len(Ws))):
        x, u, p = saved[l]
        grad_x0 += g * p  # out depends on x0 directly through x0 * p
        gp = g * x0  # d out / d p
        gb[l] = gp.sum(0)
        gW[l] = gp.T @ u
        gu = gp @ Ws[l]
        gV[l] = gu.T @ x
        g = g + gu @ Vs[l]  # the residual path plus the path through V_l x_l
    return g + grad_x0, gW, gV, gb


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as `t` [B, N], through a transposed buffer (strides (1, B))."""
    return t.t().contiguous().t()


def _check_against_reference(net: LowRankCrossNet, x: torch.Tensor, g: torch.Tensor) -> None:
    Ws = [w.detach().numpy() for w in net.W_kernels]
    Vs = [v.detach().numpy() for v in net.V_kernels]
    bs = [b.detach().numpy() for b in net.bias]
    x_np, g_np = x.detach().numpy(), g.numpy()
    ref, saved = reference_forward(x_np, Ws, Vs, bs)
    ref_gx, ref_gW, ref_gV, ref_gb = reference_backward(g_np, x_np, Ws, Vs, saved)

    xin = x.detach().requires_grad_()
    out = net(xin)
    assert out.shape == x.shape and out.dtype == torch.float64
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-12, atol=1e-12)
    out.backward(g)
    np.testing.assert_allclose(xin.grad.numpy(), ref_gx, rtol=1e-11, atol=1e-11)
    for l in range(len(Ws)):
        np.testing.assert_allclose(net.W_kernels[l].grad.numpy(), ref_gW[l], rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(net.V_kernels[l].grad.numpy(), ref_gV[l], rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(net.bias[l].grad.numpy(), ref_gb[l], rtol=1e-11, atol=1e-11)


def _randomise_(net: LowRankCrossNet) -> None:
    """Non-zero biases (the init's are zero, which would hide a bias bug) and O(1) weights."""
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.5)


# ---------------------------------------------------------------------------------------------
# LowRankCrossNet


@pytest.mark.parametrize("batch, n, layers, rank", [
    (1, 2, 1, 1),      # one sample, F = 1 and D = 1: N = (F+1) D = 2; rank 1
    (3, 10, 3, 4),     # F = 4, D = 2
    (127, 27, 2, 5),   # F = 26, D = 1; odd everything
    (3, 6, 2, 9),      # rank above N (allowed, as in TorchRec)
])
def test_cross_net_matches_reference(batch, n, layers, rank):
    torch.manual_seed(batch + n)
    net = LowRankCrossNet(n, layers, rank).double()
    _randomise_(net)
    x = torch.randn(batch, n, dtype=torch.float64)
    g = torch.randn(batch, n, dtype=torch.float64)
    _check_against_reference(net, x, g)


def test_cross_net_noncontiguous_input_and_gradient():
    torch.manual_seed(1)
    net = LowRankCrossNet(12, 3, 5).double()
    _randomise_(net)
    x = _noncontiguous(torch.randn(7, 12, dtype=torch.float64))
    g = torch.randn(12, 7, dtype=torch.float64).t()  # strides (1, 7)
    assert not x.is_contiguous() and not g.is_contiguous()
    _check_against_reference(net, x, g)
    # an expanded (stride-0) gradient, what sum() hands back
    net.zero_grad()
    _check_against_reference(net, x, torch.ones(1, 1, dtype=torch.float64).expand(7, 12))


def test_cross_net_gradcheck():
    torch.manual_seed(2)
    net = LowRankCrossNet(6, 2, 3).double()
    _randomise_(net)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    params = list(net.parameters())

    def f(x, *ps):
        return torch.func.functional_call(net, dict(zip([n for n, _ in net.named_parameters()], ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params))


def test_cross_net_torchrec_names_shapes_and_init():
    torch.manual_seed(3)
    net = LowRankCrossNet(40, 3, 8)
    assert list(net.state_dict()) == [f"{k}.{l}" for k in ("W_kernels", "V_kernels", "bias") for l in range(3)]
    assert [tuple(net.W_kernels[l].shape) for l in range(3)] == [(40, 8)] * 3
    assert [tuple(net.V_kernels[l].shape) for l in range(3)] == [(8, 40)] * 3
    assert [tuple(net.bias[l].shape) for l in range(3)] == [(40,)] * 3
    assert all(torch.equal(b, torch.zeros(40)) for b in net.bias)
    # TorchRec's draws: xavier_normal_ on every W (in layer order), then on every V
    torch.manual_seed(3)
    Ws = [torch.nn.init.xavier_normal_(torch.empty(40, 8)) for _ in range(3)]
    Vs = [torch.nn.init.xavier_normal_(torch.empty(8, 40)) for _ in range(3)]
    for l in range(3):
        assert torch.equal(net.W_kernels[l], Ws[l]) and torch.equal(net.V_kernels[l], Vs[l])


def test_cross_net_init_scale():
    torch.manual_seed(4)
    net = LowRankCrossNet(432, 3, 128)
    expected = (2.0 / (432 + 128)) ** 0.5  # xavier normal, gain 1
    for w in [*net.W_kernels, *net.V_kernels]:
        assert abs(w.std().item() / expected - 1) < 0.03


def test_cross_net_identity_when_w_zero():
    """With W = 0 and b = 0 every layer is the identity; with b = 1 each doubles through x0."""
    net = LowRankCrossNet(5, 2, 3).double()
    with torch.no_grad():
        for w in net.W_kernels:
            w.zero_()
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(net(x), x, rtol=0, atol=0)
    with torch.no_grad():
        for b in net.bias:
            b.fill_(1.0)
    torch.testing.assert_close(net(x), 3 * x, rtol=0, atol=0)  # x -> 2x -> 3x


def test_cross_net_under_bf16_autocast_stays_bf16_and_tracks_float64():
    """The residual stream keeps the GEMMs' dtype (bf16) under autocast: output and input gradient are
    bf16, not promoted to fp32 by the fp32 bias; values within bf16 rounding of the float64 net on the
    same (bf16-representable) input, parameters fp32 with fp32 gradients."""
    torch.manual_seed(5)
    net = LowRankCrossNet(40, 3, 8)
    _randomise_(net)
    x = torch.randn(6, 40).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(6, 40).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
    out.backward(g)
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for p in net.parameters())
    ref_net = copy.deepcopy(net).double()
    xr = x.detach().double().requires_grad_(True)
    ref = ref_net(xr)
    ref.backward(g.double())
    scale = float(ref.abs().max())
    # bf16 steps (2**-8 relative) through 3 layers of 2 GEMMs each: a few percent of the output's scale
    torch.testing.assert_close(out.double(), ref, rtol=0.03, atol=0.03 * scale)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=0.03, atol=0.03 * float(xr.grad.abs().max()))
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=0.05, atol=0.05 * float(q.grad.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layers, rank", [(0, 4), (2, 0)])
def test_cross_net_refuses_empty(layers, rank):
    with pytest.raises(ValueError, match="must be >= 1"):
        LowRankCrossNet(8, layers, rank)


# ---------------------------------------------------------------------------------------------
# InteractionArch(kind="dcn")


@pytest.mark.parametrize("batch, num_features, dim", [(1, 1, 3), (3, 4, 2), (127, 26, 1)])
def test_dcn_interaction_is_crossnet_of_the_concatenation(batch, num_features, dim):
    torch.manual_seed(5)
    arch = InteractionArch(num_features, dim, "dcn", cross_layers=2, cross_rank=3).double()
    _randomise_(arch.crossnet)
    assert arch.output_dim == (num_features + 1) * dim
    dense = torch.randn(batch, dim, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(batch, num_features, dim, dtype=torch.float64, requires_grad=True)
    out = arch(dense, sparse)
    assert out.shape == (batch, arch.output_dim)
    # TorchRec's InteractionDCNArch order: the dense vector, then feature 0, 1, ... (each D wide)
    x0 = np.concatenate([dense.detach().numpy(), sparse.detach().numpy().reshape(batch, -1)], axis=1)
    Ws = [w.detach().numpy() for w in arch.crossnet.W_kernels]
    Vs = [v.detach().numpy() for v in arch.crossnet.V_kernels]
    bs = [b.detach().numpy() for b in arch.crossnet.bias]
    ref, saved = reference_forward(x0, Ws, Vs, bs)
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-12, atol=1e-12)
    g = torch.randn(batch, arch.output_dim, dtype=torch.float64)
    out.backward(g)
    ref_gx, ref_gW, ref_gV, ref_gb = reference_backward(g.numpy(), x0, Ws, Vs, saved)
    np.testing.assert_allclose(dense.grad.numpy(), ref_gx[:, :dim], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(sparse.grad.numpy(), ref_gx[:, dim:].reshape(batch, num_features, dim), rtol=1e-11, atol=1e-11)
    for l in range(2):
        np.testing.assert_allclose(arch.crossnet.W_kernels[l].grad.numpy(), ref_gW[l], rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(arch.crossnet.V_kernels[l].grad.numpy(), ref_gV[l], rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(arch.crossnet.bias[l].grad.numpy(), ref_gb[l], rtol=1e-11, atol=1e-11)


def test_dcn_interaction_state_dict_keys_and_no_crossnet_for_dot():
    arch = InteractionArch(26, 16, "dcn", cross_layers=3, cross_rank=64)
    assert list(arch.state_dict()) == [f"crossnet.{k}.{l}" for k in ("W_kernels", "V_kernels", "bias") for l in range(3)]
    assert tuple(arch.crossnet.W_kernels[0].shape) == (432, 64)
    assert list(InteractionArch(26, 16, "dot").state_dict()) == []
    assert list(InteractionArch(26, 16, "cat").state_dict()) == []


def test_dcn_model_builds_trains_and_pads():
    torch.manual_seed(6)
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction="dcn", cross_layers=2,
                      cross_rank=5, top_mlp_input_multiple=8)
    model = build_model(cfg, [7] * 26, kernels=KernelsConfig(embedding="torch", interaction="torch", mlp="torch", loss="torch"))
    assert model.interaction_arch.output_dim == 112  # 27 * 4 = 108, padded to a multiple of 8
    assert model.over_arch.model.layers[0].in_features == 112
    keys = [k for k in model.state_dict() if "crossnet" in k]
    assert keys == [f"interaction_arch.inner.crossnet.{k}.{l}" for k in ("W_kernels", "V_kernels", "bias") for l in range(2)]
    dense, sparse = torch.randn(3, 13), torch.randint(0, 100, (3, 26))
    logits = model(dense, sparse)
    assert logits.shape == (3,)
    logits.sum().backward()
    crossnet = model.interaction_arch.inner.crossnet
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in crossnet.parameters())
    assert crossnet.bias[0].grad.abs().sum() > 0


def test_dcn_model_state_dict_without_padding():
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction="dcn", cross_layers=1, cross_rank=2)
    model = build_model(cfg, [5] * 26)
    assert [k for k in model.state_dict() if "interaction" in k] == [
        "interaction_arch.crossnet.W_kernels.0", "interaction_arch.crossnet.V_kernels.0", "interaction_arch.crossnet.bias.0"]
    assert model.over_arch.model.layers[0].in_features == 27 * 4


# ---------------------------------------------------------------------------------------------
# Config, fast path, resume policy


def test_config_defaults_and_values():
    m = config_from_dict({"model": {"interaction": "dcn"}}).model
    assert (m.interaction, m.cross_layers, m.cross_rank) == ("dcn", 3, 512)
    m = config_from_dict({"model": {"interaction": "dcn", "cross_layers": 1, "cross_rank": 1}}).model
    assert (m.cross_layers, m.cross_rank) == (1, 1)


@pytest.mark.parametrize("model, message", [
    ({"interaction": "dcn", "cross_rank": 0}, r"^x\.json: model\.cross_rank: 0 must be > 0$"),
    ({"interaction": "dcn", "cross_rank": -3}, r"^x\.json: model\.cross_rank: -3 must be > 0$"),
    ({"interaction": "dcn", "cross_layers": 0}, r"^x\.json: model\.cross_layers: 0 must be > 0$"),
    ({"interaction": "dcn", "cross_rank": 2.5}, r"^x\.json: model\.cross_rank: expected an integer"),
    ({"interaction": "dcn", "cross_layers": 2**40}, r"^x\.json: model\.cross_layers: 1099511627776 must be <= 2147483647$"),
    ({"interaction": "dcn", "bottom_mlp": [64, 8]},
     r"^x\.json: model\.bottom_mlp\[-1\]: 8 must equal model\.embedding_dim \(16\) for the dcn interaction"),
    ({"interaction": "dcnv2"}, r"model\.interaction: 'dcnv2' is not one of 'dot' \| 'cat' \| 'dcn'"),
])
def test_config_errors_are_one_line_naming_the_key(model, message):
    with pytest.raises(ConfigError, match=message) as e:
        config_from_dict({"model": model}, "x.json")
    assert "\n" not in str(e.value)


def test_fast_path_keeps_the_dot_kernel_off_for_dcn():
    cfg = config_from_dict({"model": {"interaction": "dcn"}})
    resolved, chosen = resolve_fast_path(cfg, torch.device("cuda"))  # resolution only reads the device type
    assert resolved.kernels.interaction == "torch" and resolved.kernels.embedding == "triton"
    assert chosen["kernels.interaction"]["why"]


@pytest.mark.parametrize("key, value", [("cross_layers", 2), ("cross_rank", 256), ("interaction", "dot")])
def test_resume_refuses_a_changed_cross_network(key, value):
    saved = config_from_dict({"model": {"interaction": "dcn"}}).to_dict()
    current = config_from_dict({"model": {"interaction": "dcn", key: value}}).to_dict()
    with pytest.raises(ConfigError, match=f"model.{key}"):
        check_resume_config(saved, current, (), "ckpt.pt")
    check_resume_config(saved, current, (f"model.{key}",), "ckpt.pt")  # unless allowed


# ---------------------------------------------------------------------------------------------
# configs/kaggle-dcn.json end to end on a tiny synthetic dataset (CPU): training with profiling,
# checkpoints and exact resume, torch.compile, --export; the whole-step CUDA graph on a GPU

KAGGLE_DCN = REPO / "configs" / "kaggle-dcn.json"


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    """Made once per test run, shared by the pytest-xdist workers (`tests.shared_once`: each worker that ran a test of
    this module generated its own, ~2 s each in CI). Tests only read it (their runs hold it for reading)."""
    from tests.shared_once import computed_once

    def make(root):
        proc = subprocess.run([sys.executable, "-m", "dlrm.data.synthetic", "--rows", "3000", "--cardinalities", "tiny",
                               "--out", str(root / "syn")], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    return computed_once(tmp_path_factory, "dcn-syn-tiny", make) / "syn"


def kaggle_dcn(dataset, tmp_path, run_name, **overrides):
    """configs/kaggle-dcn.json on the tiny dataset (its metadata's table sizes replace the config's),
    CPU-sized: batch 64, a few steps, deterministic, a checkpoint every 4 steps."""
    base = {"data.path": str(dataset), "data.batch_size": 64, "data.shuffle": True, "train.device": "cpu",
            "train.max_steps": 8, "train.log_every": 2, "train.deterministic": True, "train.baseline": False,
            "log.tb_dir": str(tmp_path / "tb"), "log.run_name": run_name, "checkpoint.every": 4, "checkpoint.keep": 5}
    return load_config(KAGGLE_DCN, {**base, **overrides})


def test_kaggle_dcn_config_is_the_kaggle_model_with_a_cross_network():
    dcn, dot = load_config(KAGGLE_DCN), load_config(REPO / "configs" / "kaggle.json")
    assert (dcn.model.interaction, dcn.model.cross_layers, dcn.model.cross_rank) == ("dcn", 3, 128)
    for key in ("embedding_dim", "bottom_mlp", "top_mlp", "cardinalities", "activation"):
        assert getattr(dcn.model, key) == getattr(dot.model, key), key
    assert (dcn.optim.dense.name, dcn.optim.sparse.name) == ("adagrad", "rowwise_adagrad")  # MLPerf DLRM-DCNv2's
    assert dcn.data == dot.data and dcn.train == dot.train
    model = build_model(dcn.model, dcn.model.cardinalities, device="meta")  # Kaggle-sized tables, no memory
    assert model.interaction_arch.output_dim == 27 * 16 == model.over_arch.model.layers[0].in_features
    assert tuple(model.interaction_arch.crossnet.W_kernels[0].shape) == (432, 128)


def test_kaggle_dcn_trains_profiles_and_resumes_exactly(tiny_dataset, tmp_path):
    full = train(kaggle_dcn(tiny_dataset, tmp_path, "full", **{
        "profile.enabled": True, "profile.wait": 1, "profile.warmup": 1, "profile.active": 2}))
    assert full["steps"] == 8 and 0.0 < full["auc"] < 1.0
    losses = [l for _, l in full["train_losses"]]
    assert len(losses) == 4 and all(np.isfinite(losses))
    (trace,) = trace_files(tmp_path / "tb" / "full")
    names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert {"InteractionArch", "OverArch", "backward", "optimizer"} <= names

    train(kaggle_dcn(tiny_dataset, tmp_path, "parts", **{"train.max_steps": 4}))
    resumed = train(kaggle_dcn(tiny_dataset, tmp_path, "parts"), resume="latest")
    assert resumed["steps"] == 8 and resumed["resumed_at_step"] == 4  # steps 5-8 only (a restart ends the same)
    assert [l for _, l in resumed["train_losses"]] == losses  # bit for bit
    a = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "full")[-1])
    b = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "parts")[-1])
    assert a["position"] == b["position"]
    crossnet = [k for k in a["model"] if ".crossnet." in k]
    assert len(crossnet) == 9  # W, V and bias of 3 layers
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for oa, ob in zip(a["optimizers"], b["optimizers"]):
        assert oa["state"].keys() == ob["state"].keys() and oa["state"]
        for pid, st in oa["state"].items():
            for name, value in st.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][pid][name])), (pid, name)
    # the cross network trained: its biases left their zero init
    assert all(a["model"][k].abs().sum() > 0 for k in crossnet if ".bias." in k)


def test_kaggle_dcn_compiled_matches_eager(tiny_dataset, tmp_path):
    """--compile once (tiny: 4 steps): no graph breaks, the eager run's losses."""
    eager = train(kaggle_dcn(tiny_dataset, tmp_path, "eager", **{"train.max_steps": 4}))
    compiled = train(kaggle_dcn(tiny_dataset, tmp_path, "compiled", **{"train.max_steps": 4, "train.compile.enabled": True}))
    assert compiled["compile"]["graph_breaks"] == 0 and compiled["compile"]["graphs"] >= 1  # compiled, unbroken
    assert eager["compile"]["graphs"] == 0
    for (s1, l1), (s2, l2) in zip(eager["train_losses"], compiled["train_losses"]):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-4)
    assert compiled["auc"] == pytest.approx(eager["auc"], abs=1e-3)


def test_kaggle_dcn_export_predicts_like_the_model(tiny_dataset, tmp_path):
    cfg = kaggle_dcn(tiny_dataset, tmp_path, "exp", **{"train.max_steps": 4})
    summary = train(cfg)
    run_dir = tmp_path / "tb" / "exp"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(KAGGLE_DCN), "--data", str(tiny_dataset),
                           "--device", "cpu", "--checkpoint", str(run_dir),
                           "--export", str(tmp_path / "dcn.pt2")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    from dlrm.data.loader import transform_dense
    from dlrm.train.export import model_from_checkpoint
    from dlrm.train.trainer import build_for_data

    _, _, _, tables = build_for_data(cfg)
    model = model_from_checkpoint(cfg, summary["checkpoint"], tables, torch.device("cpu"))
    assert model.interaction_arch.kind == "dcn"
    program = torch.export.load(str(tmp_path / "dcn.pt2")).module()
    rng = np.random.default_rng(0)
    for batch in (1, 3, 33):
        counts = torch.from_numpy(rng.integers(-2, 5000, (batch, 13)))
        raw = torch.from_numpy(rng.integers(-1, 2**32, (batch, 26)))
        torch.testing.assert_close(program(counts, raw), model.predict(transform_dense(counts), raw), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("interaction", ["torch", "triton"])
def test_kaggle_dcn_whole_step_cuda_graph(interaction):
    """The DCN model in the captured step (a fused Adam: the config's Adagrad has no fused CUDA
    kernel, so "auto" turns the graph off for it): the ordinary step's losses and weights."""
    from tests.test_graphed_step import batches, graphed_step, make_run
    from tests.test_graphed_step import train as train_steps

    device = torch.device("cuda")
    cfg = load_config(KAGGLE_DCN, {"kernels.embedding": "triton", "kernels.interaction": interaction,
                                   "train.cuda_graph": True, "train.compile": False, "train.precision": "fp32",
                                   "optim.dense.name": "adam", "optim.dense.lr": 0.001, "model.cross_rank": 32})
    data = batches(8, 127, device)  # 3 warm-up steps, the capture, 4 replays
    plain = make_run(cfg, device, cuda_graph=False)
    run = make_run(cfg, device)
    graphed = graphed_step(run)
    a, b = train_steps(plain, data), train_steps(run, data)
    assert graphed.graph is not None and len(set(b[3:])) == 5
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(plain.model.state_dict().items(), run.model.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
