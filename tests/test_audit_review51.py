"""Review of the fifty-first session's changes: regressions and fixes that missed a case. Each test failed before
its fix."""

from __future__ import annotations

import torch

from dlrm import checkpoint as ckpt
from dlrm.train.adagrad import CapturableAdagrad
from dlrm.train.optim import keeps_configured_hyperparameters


def test_capturable_adagrad_keeps_its_step_counters_on_the_parameters_device_after_loading_a_cpu_adagrad_state():
    # A CPU run's torch Adagrad (foreach None) resumed on a GPU, where the dense Adagrad is CapturableAdagrad
    # (foreach True): the implementation flags differ, and keeps_configured_hyperparameters moved the step counters
    # to the CPU (neither fused nor capturable), though CapturableAdagrad steps them on the parameters' device only
    # (its own load hook had just put them there). The "meta" device stands in for the GPU on a CPU machine.
    p = torch.nn.Parameter(torch.randn(4))
    cpu = torch.optim.Adagrad([p], lr=0.1)
    p.grad = torch.ones(4)
    cpu.step()
    q = torch.nn.Parameter(torch.empty(4, device="meta"))
    opt = keeps_configured_hyperparameters(CapturableAdagrad([q], lr=0.1))
    opt.load_state_dict(cpu.state_dict())
    assert opt.param_groups[0]["foreach"] is True  # the live implementation kept
    assert opt.state[q]["step"].device == q.device
    assert opt.state[q]["sum"].device == q.device


def test_a_sweep_trial_reached_through_a_symbolic_link_resumes_from_its_checkpoint(tmp_path):
    # A stopped trial moved to another disk and linked back (<setting>/seed-0 -> elsewhere): a run reached through a
    # link resumes in place (dlrm.train.run_dir.run_of), but sweep --resume took the link for "neither a summary nor a
    # checkpoint", moved it aside and trained the trial again from step 0 (its checkpoints ignored).
    from dlrm.sweep_resume import trial_state

    real = tmp_path / "other_disk" / "seed-0"
    (real / "checkpoints").mkdir(parents=True)
    for step in (2, 4):
        (real / "checkpoints" / ckpt.checkpoint_name(step)).write_bytes(b"x")
    run_dir = tmp_path / "sweep" / "00-sparse.lr=0.1" / "seed-0"
    run_dir.parent.mkdir(parents=True)
    run_dir.symlink_to(real, target_is_directory=True)
    done, checkpoint = trial_state(run_dir, {}, "sweep trial 1/1")
    assert done is None
    assert checkpoint == run_dir / "checkpoints" / ckpt.checkpoint_name(4)
    assert run_dir.is_symlink() and not (run_dir.parent / "seed-0.interrupted").exists()  # nothing moved aside
