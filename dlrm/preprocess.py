"""``python -m dlrm.preprocess``: raw Criteo logs to a dataset (see `dlrm.data.preprocess`)."""
from dlrm.data.preprocess import main

if __name__ == "__main__":
    main()
