"""Multi-process training under ``torchrun``: torch.distributed (NCCL on GPUs, gloo on the CPU).

- `env`: the process group and the few collectives the trainer needs (no-ops in one process).
- `sharding`: which rank holds which embedding rows (table-wise / row-wise).
- `sharded_embedding`: the sharded SparseArch, lookups exchanged with all_to_all.
- `checkpoint`: sharded checkpoints and the tool that merges them for one GPU.
"""
