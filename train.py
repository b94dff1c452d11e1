"""Train a DLRM: `python train.py --config configs/sample.json` (see README.md)."""

from dlrm.cli import main
from dlrm.stop_signal import LateSignals

if __name__ == "__main__":
    LateSignals.until_exit = True  # the process's program: a signal once the results are written stops nothing
    main()
