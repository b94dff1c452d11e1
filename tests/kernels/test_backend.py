"""Asking for Triton where it cannot run fails with `TritonUnavailableError`, never a silent fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels import TritonUnavailableError, check_triton_device, interpret_mode
from kernels.embedding import embedding_lookup, embedding_sparse_update_
from kernels.epilogue import act_backward
from kernels.interaction import dot_interaction
from kernels.linear import linear_act
from kernels.loss import bce_with_logits
from tests.conftest import REPO


@pytest.fixture
def no_interpreter(monkeypatch):
    """The CPU without TRITON_INTERPRET=1 (the check reads the variable at call time)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpret_mode()


def test_check_triton_device(no_interpreter):
    with pytest.raises(TritonUnavailableError, match="TRITON_INTERPRET=1"):
        check_triton_device("cpu")
    with pytest.raises(TritonUnavailableError, match="device type 'meta'"):
        check_triton_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(TritonUnavailableError, match="CUDA is not available"):
            check_triton_device("cuda")
    else:
        check_triton_device("cuda")
    assert issubclass(TritonUnavailableError, RuntimeError)


def test_check_passes_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_triton_device("cpu") is None  # accepted: returns, raises nothing
    assert check_triton_device(torch.device("cpu"), what="the pooled lookup") is None
    with pytest.raises(TritonUnavailableError, match="device type 'meta'"):  # the interpreter runs the CPU only
        check_triton_device("meta")


def test_every_op_refuses_cpu_without_interpreter(no_interpreter):
    x = torch.randn(3, 16)
    calls = {
        "linear": lambda: linear_act(x, torch.randn(4, 16), torch.randn(4), "relu"),
        "interaction": lambda: dot_interaction(torch.randn(3, 5, 16)),
        "loss": lambda: bce_with_logits(torch.randn(3), torch.ones(3)),
        "act_backward": lambda: act_backward(x, x, "relu", True, bias_grad=True),
        "embedding": lambda: embedding_lookup(torch.zeros(3, 2, dtype=torch.int64), torch.randn(10, 16),
                                              torch.tensor([5, 5]), torch.tensor([0, 5])),
        "sparse_update": lambda: embedding_sparse_update_(torch.zeros(3, 2, dtype=torch.int64), torch.randn(3, 2, 16),
                                                          torch.randn(10, 16), None, torch.tensor([0.1]), "sgd"),
    }
    for name, call in calls.items():
        with pytest.raises(TritonUnavailableError, match="TRITON_INTERPRET"):
            call()
        print(name, "refused")


def test_build_model_refuses(no_interpreter):
    from dlrm.config import KernelsConfig, ModelConfig
    from dlrm.model.dlrm import build_model

    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
    for k in ("embedding", "interaction", "mlp", "loss"):
        with pytest.raises(TritonUnavailableError, match=f'kernels.{k} "triton"'):
            build_model(cfg, [5] * 26, kernels=KernelsConfig(**{k: "triton"}), device="cpu")
    # named as set, not as "--kernels triton" (a config's kernels.mlp "fused" was reported as a flag never given)
    with pytest.raises(TritonUnavailableError, match='^kernels.mlp "fused" \\(Triton kernels\\) cannot run on the CPU'):
        build_model(cfg, [5] * 26, kernels=KernelsConfig(mlp="fused"), device="cpu")


def test_fresh_process_without_interpreter_fails_clearly():
    """A process that imported triton without TRITON_INTERPRET (and sees no GPU) gets the error, not a crash
    deep inside triton's launcher."""
    code = textwrap.dedent(
        """
        import torch
        from kernels import TritonUnavailableError
        from kernels.linear import linear_act
        try:
            linear_act(torch.randn(2, 3), torch.randn(4, 3))
        except TritonUnavailableError as e:
            print("REFUSED:", e)
        else:
            print("RAN")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "REFUSED:" in res.stdout and "TRITON_INTERPRET=1" in res.stdout, res.stdout + res.stderr[-2000:]
