"""Train a DLRM: `python train.py --config configs/sample.json` (see README.md)."""

from dlrm.cli import main

if __name__ == "__main__":
    main()
