"""What a new user read, following README.md top to bottom, that said otherwise than the program does."""

from __future__ import annotations

from click.testing import CliRunner

from dlrm.cli import main


def test_export_help_names_the_model_a_training_run_exports():
    # `train.py --config C --export M.pt2` exports the run's best.pt (`dlrm.cli`: `_best_checkpoint(summary) or
    # summary["checkpoint"]`), as README's "Checkpoints, resume, evaluation, export" says; --help said "from the
    # model at the end of training": on the small-real path (best AUC at step 335 of 399) the log named step 335.
    res = CliRunner().invoke(main, ["--help"], terminal_width=200)
    assert res.exit_code == 0
    export_help = " ".join(res.output.split("--export TEXT", 1)[1].split("-h, --help", 1)[0].split())
    assert "end of training" not in export_help
    assert "after training from the run's best.pt" in export_help
