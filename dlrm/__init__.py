"""DLRM training on Criteo-style click logs (README.md).

Importing the package first (``python train.py``, ``python -m dlrm.<tool>``) sets ``OMP_WAIT_POLICY=PASSIVE``
where neither it nor ``GOMP_SPINCOUNT`` is set, before torch (and the libgomp its CPU ops run on) is loaded: libgomp's
threads otherwise spin ~300,000 times waiting for the next parallel region before they sleep, and on a machine whose
cores other work keeps busy (a CI runner, a shared host) the spinning threads took the cores the training thread
needed. configs/sample.json on a 2-core machine beside the test suite: 48-163 s with the spinning, 22-27 s without
(2026-12-04; `benchmarks/omp_wait_policy.py`). A user's own setting of either variable is kept.
"""

import os as _os

if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
