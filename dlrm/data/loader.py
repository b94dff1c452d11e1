"""The streaming parquet loader's public names, in one place (`from dlrm.data.loader import ...`).

The loader lives in files of one job each, re-exported here so that callers keep one import:

- `dlrm.data.batch`: `Batch`, epoch and rank arithmetic, the device-side transforms;
- `dlrm.data.validation`: per-file checks (schema, labels, nulls) and a split's file list;
- `dlrm.data.host_arena`: the host buffers reader threads decode into;
- `dlrm.data.parquet_loader`: `ParquetLoader`, the threaded decode-upload-cut pipeline.

`dlrm.data.device_loader` keeps a whole split in GPU memory instead.
"""

# The private names (_HostBlock, _LOW32, _END, ...) are re-exported too: dlrm.data.device_loader and
# benchmarks/loader_throughput.py import them from here.
from dlrm.data.batch import (  # noqa: F401
    _LOW32,
    Batch,
    batches_per_epoch,
    check_rank_batch,
    compact_limit,
    compact_range,
    keeps_last_batch,
    rank_rows,
    rank_slice,
    transform_dense,
    widen_sparse,
)
from dlrm.data.host_arena import (  # noqa: F401
    _TRANSPOSE_ROWS,
    _Arena,
    _column_array,
    _HostBlock,
    _write_columns,
    compact_sparse_ok,
    list_slots,
)
from dlrm.data.parquet_loader import _END, ParquetLoader, _Flush, _Resident  # noqa: F401
from dlrm.data.validation import (  # noqa: F401
    _NULL_FILL,
    NullTally,
    _label_error,
    check_labels,
    check_schema,
    check_table,
    file_layout,
    first_rows,
    footer_label_check,
    list_lengths,
    open_footer,
    open_shard,
    split_files,
)

__all__ = [
    "Batch",
    "NullTally",
    "ParquetLoader",
    "batches_per_epoch",
    "check_labels",
    "check_schema",
    "check_table",
    "compact_limit",
    "compact_range",
    "compact_sparse_ok",
    "file_layout",
    "first_rows",
    "footer_label_check",
    "keeps_last_batch",
    "list_lengths",
    "list_slots",
    "open_footer",
    "open_shard",
    "rank_rows",
    "rank_slice",
    "split_files",
    "transform_dense",
    "widen_sparse",
]
