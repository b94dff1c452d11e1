"""A sweep holds each trial's dataset from its first trial to the sweep's end: a tool's ``--overwrite`` between two
trials replaced it, and the later trials trained on other rows than the earlier ones they are compared with."""

import os

import click

from dlrm.data.synthetic import generate
from dlrm.sweep import run_sweep
from dlrm.train.trainer import train
from tests.test_audit_concurrent import write_config


def test_a_dataset_is_not_replaced_between_two_trials(tmp_path):
    data = tmp_path / "D"
    generate(data, rows=600, seed=1)
    before = (data / "metadata.json").read_text()
    refusals, trained = [], []

    def train_then_regenerate(cfg, **kwargs):
        summary = train(cfg, **kwargs)
        trained.append((data / "metadata.json").read_text())
        try:
            generate(data, rows=600, seed=2, overwrite=True)  # (another process, in the test this one)
        except click.ClickException as e:
            refusals.append(e.format_message())
        return summary

    config = write_config(tmp_path, data)
    run_sweep(str(config), [("optim.dense.lr", [0.01, 0.02])], 1, {"train.max_steps": 2}, tb_dir=str(tmp_path / "tb"),
              run_name="sw", train_fn=train_then_regenerate)
    assert trained == [before, before]  # both trials on the dataset the sweep started on
    assert len(refusals) == 2 and all(f"in use by pid {os.getpid()} on " in r for r in refusals)
    assert not list(tmp_path.glob(".D.lock"))  # the sweep's hold went with it
    generate(data, rows=600, seed=2, overwrite=True)  # free again once the sweep ended
