"""A new user's journey through README.md and data/README.md (session 58's audit): what the commands print."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import CHILD_ENV

ROOT = Path(__file__).resolve().parents[1]

# Both masked lookups' backward, as a multi-hot eager run (or a sharded one) runs it, in a fresh process: torch warns
# once a process, so an earlier test's sparse tensor would hide it here.
_MASKED_BACKWARD = """
import warnings
warnings.simplefilter("always")  # PYTHONWARNINGS=always's filter, without the fresh interpreter a changed one starts
import torch
from dlrm.model.masked_lookup import masked_embedding, masked_embedding_bag
w = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2))
masked_embedding(torch.tensor([1, 0, 1]), w, torch.tensor([True, False, True])).sum().backward()
print(w.grad.coalesce().to_dense().tolist())
v = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2))
rows, keep = torch.tensor([1, 0, 3]), torch.tensor([True, False, True])
out = masked_embedding_bag(rows, v, keep, torch.tensor([0, 2]), torch.tensor([0, 0, 1]))
(out * torch.tensor([[1.0], [2.0]])).sum().backward()
print(v.grad.coalesce().to_dense().tolist())
"""


def test_the_masked_lookups_sparse_gradient_warns_of_no_memory_errors():
    """A multi-hot eager run (README: MLPerf's model on a CPU with fp32 tables) printed torch 2.13's "Sparse invariant
    checks are implicitly disabled. Memory errors (e.g. SEGFAULT) will occur ..." at its first backward."""
    env = CHILD_ENV  # the caller's PYTHONPATH kept (the GPU machine's loguru)
    done = subprocess.run([sys.executable, "-c", _MASKED_BACKWARD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "invariant" not in done.stderr, done.stderr
    embedding, bag = done.stdout.splitlines()
    assert embedding == str([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]])  # row 0: the masked lookup's
    assert bag == str([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])


def _raw_log(path: Path, lines: int) -> Path:
    """`lines` lines of Kaggle's raw train.txt format: a label, 13 counts and 26 hex categories (a few values each)."""
    rows = []
    for i in range(lines):
        cats = [f"{(i * 7 + f) % 5 + 16 * f:08x}" for f in range(26)]
        rows.append("\t".join([str(i % 2)] + [str(i % 9)] * 13 + cats))
    path.write_text("\n".join(rows) + "\n")
    return path


def _preprocess_log(tmp_path: Path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "dlrm.preprocess", "--input", str(_raw_log(tmp_path / "log.txt", 200)),
                           "--output", str(out), "--hashing", "vocabulary", "--min-frequency", "auto", "--workers", "1",
                           "--no-progress", *args], cwd=ROOT, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from dlrm.data.schema import read_metadata

    meta = read_metadata(out)
    line = next(x for x in done.stderr.splitlines() if "--min-frequency auto:" in x)
    return line, {s: i.rows for s, i in meta.splits.items()}


def test_min_frequency_auto_says_a_random_splits_train_rows_are_its_expected_count(tmp_path):
    """README "A few hundred rows": both real samples split at random logged `--min-frequency auto: 2 for 180 train
    rows`, and the split's table then said 165: the count is the split's expectation, drawn before any line is."""
    line, rows = _preprocess_log(tmp_path, "--split", "random", "--validation-fraction", "0.3", "--test-fraction",
                                 "0.1")
    assert rows["train"] != 120  # (this seed draws another count than the expectation, as the samples' 165)
    assert "for 120 train rows (" in line and line.endswith(", the expected count of --split random)"), line


def test_min_frequency_auto_of_a_sequential_split_names_its_exact_train_rows(tmp_path):
    line, rows = _preprocess_log(tmp_path)
    assert rows["train"] == 172  # 6/7 of 200 lines
    assert f"for {rows['train']} train rows (clip(" in line and "expected" not in line, line


def test_the_dense_parts_ddp_prints_no_deprecation_warning(tmp_path):
    """README "Several GPUs": `torchrun --nproc-per-node 2 train.py ... --device cpu` printed torch 2.13's FutureWarning
    "`broadcast_buffers` is deprecated ..." with its source line, once a rank, in every run."""
    import warnings

    import torch
    import torch.distributed as dist

    from dlrm.config import ModelConfig
    from dlrm.distributed.data_parallel import wrap_dense_parts
    from dlrm.model.dlrm import build_model

    model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [5] * 26, device="cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = wrap_dense_parts(model, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert [str(w.message) for w in caught if "broadcast_buffers" in str(w.message)] == []
    assert ddp.broadcast_buffers is False  # still no per-step broadcast of the constant buffers
