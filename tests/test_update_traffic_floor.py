"""benchmarks/update_traffic_floor.py: the pooled update's traffic without its arithmetic (CPU: the interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.test_benchmark_scripts import load_script, read_csv


def test_smoke_times_every_case_and_writes_its_files(tmp_path):
    utf = load_script("update_traffic_floor")
    assert utf.main(["--smoke", "--out", str(tmp_path), "--name", "u", "--skeleton-launches", "32:2"]) == 0
    rows = read_csv(tmp_path / "u.csv")
    assert [r["case"] for r in rows] == ["update", "rmw+gather", "rmw", "gather", "rmw+gather@32:2", "copy"]
    assert all(float(r["ms"]) > 0 and float(r["gbytes"]) > 0 for r in rows[:5])
    assert rows[4]["gbytes"] == rows[1]["gbytes"]  # the same bytes at another launch
    assert float(rows[-1]["gbps"]) > 0 and (tmp_path / "u.png").stat().st_size > 0
    assert "| rmw+gather |" in (tmp_path / "u.md").read_text()
    for bad in ("3:1", "32", "x:1"):
        with pytest.raises(SystemExit):
            utf.main(["--smoke", "--out", str(tmp_path), "--skeleton-launches", bad])


def test_the_skeleton_writes_each_distinct_row_once_and_never_the_padding(tmp_path):
    """The read-modify-write skeleton touches what the update touches: every distinct row < R of the batch (from
    its segment's last position), nothing else; the gradient it adds is that position's gathered row."""
    utf = load_script("update_traffic_floor")
    from kernels.embedding import update

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: under the interpreter
    R, D, B = 40, 16, 3
    slot = torch.tensor([0, 0, 1, 2, 2, 2])  # L = 6 slots of F = 3 features
    rows = torch.randint(0, R, (B, 6))
    rows[0, 1] = R  # a padding slot: sorts last, never written
    rows[2, 4] = R
    grad = torch.arange(1, B * 3 + 1, dtype=torch.float32).reshape(B, 3, 1).expand(B, 3, D).to(torch.bfloat16)
    weight = torch.zeros(R, D, dtype=torch.bfloat16)
    state = torch.zeros(R)
    sorted_rows, perm = update.sort_by_row(rows, R)
    on = [t.to(dev) for t in (sorted_rows, perm, slot, grad, weight, state, torch.zeros(4, D))]
    utf.skeleton("rmw+gather", *on)
    weight, state = on[4].cpu(), on[5].cpu()
    distinct = sorted(set(rows[rows < R].tolist()))
    assert sorted(torch.nonzero(state).flatten().tolist()) == distinct
    for r in distinct:  # the last position (sorted, stable) of row r: its gradient row's value
        p = int(perm[(sorted_rows == r).nonzero().max()])
        g = float(grad[p // 6, int(slot[p % 6]), 0])
        assert state[r].item() == g * g * D
        # one bf16 rounding of g * 1e-3 (the interpreter's cast truncates, a GPU's rounds to nearest)
        torch.testing.assert_close(weight[r].float(), torch.full((D,), g * 1e-3), rtol=2**-7, atol=0)
    assert float(weight[[r for r in range(R) if r not in distinct]].abs().sum()) == 0.0
