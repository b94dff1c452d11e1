"""benchmarks/kernels.py's ADAPTER: every call into kernels/ (and the eager references) lives here (the kernels'
APIs may move). Moved out of kernels.py unchanged (the 600-line rule)."""

from __future__ import annotations

import importlib

import torch.nn.functional as F

from dlrm.model.archs import dot_interaction_from_combined
from dlrm.model.hashing import modulus_rows


# ====================================================================================================
# ADAPTER: every call into kernels/ (and the eager references) lives here.
# ====================================================================================================


def _kmod(name: str):
    """Import kernels.<name> lazily: a module broken mid-edit fails its own cases only."""
    return importlib.import_module(f"kernels.{name}")


def tr_hash_rows(raw, cards, offs):
    return _kmod("embedding").hash_rows(raw, cards, offs)


def tr_embedding_lookup(raw, weight, cards, offs):
    return _kmod("embedding").embedding_lookup(raw, weight, cards, offs)


def tr_embedding_sgd_update_(rows, grad, weight, lr, deterministic=True):
    _kmod("embedding").embedding_sparse_update_(rows, grad, weight, None, lr, "sgd", deterministic=deterministic)


def tr_fused_embedding(raw, weight, cards, offs, lr, trigger, deterministic=True):
    """Lookup whose backward applies SGD to the looked-up rows (weight must not require grad)."""
    return _kmod("embedding").fused_embedding(
        raw, weight, cards, offs, None, None, None, lr, "sgd", deterministic=deterministic, grad_trigger=trigger
    )


def tr_dot_interaction(x):
    return _kmod("interaction").dot_interaction(x)


def tr_linear_relu(x, w, b, allow_tf32):
    return _kmod("linear").linear_act(x, w, b, "relu", allow_tf32=allow_tf32)


def tr_bce(logits, labels):
    return _kmod("loss").bce_with_logits(logits, labels, "mean")


def tr_cross_layer(x0, x, u, w, b, allow_tf32):
    return _kmod("cross").cross_layer(x0, x, u, w, b, allow_tf32)


def eager_hash_rows(raw, cards, offs):
    return modulus_rows(raw, cards, offs)


def eager_embedding_fwd(raw, weight, cards, offs):
    """SparseArch.forward without the sparse-gradient flag: modulus hashing, then the gather."""
    return F.embedding(modulus_rows(raw, cards, offs), weight)


def eager_embedding_sgd_update_(rows, grad, weight, lr: float):
    """What SGD does with the lookup's sparse COO gradient (w[rows] -= lr * g), without building it."""
    weight.index_add_(0, rows.reshape(-1), grad.reshape(-1, weight.shape[1]), alpha=-lr)


def eager_embedding_step(raw, weight, cards, offs, grad, lr: float):
    """Forward lookup followed by the SGD update from `grad` (the eager counterpart of fused_embedding)."""
    rows = modulus_rows(raw, cards, offs)
    out = F.embedding(rows, weight)
    weight.index_add_(0, rows.reshape(-1), grad.reshape(-1, weight.shape[1]), alpha=-lr)
    return out


def eager_interaction(x, tril_rows, tril_cols):
    return dot_interaction_from_combined(x, tril_rows, tril_cols)


def eager_linear_relu(x, w, b):
    return F.relu(F.linear(x, w, b))


def eager_bce(logits, labels):
    return F.binary_cross_entropy_with_logits(logits, labels)


def eager_cross_layer(x0, x, u, w, b):
    """The second half of an eager LowRankCrossNet layer: cuBLAS ``u @ w^T``, then the elementwise cross."""
    return x0 * (F.linear(u, w) + b) + x
