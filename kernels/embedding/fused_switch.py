"""The switch between a trainable embedding weight and one updated inside its own backward (no Triton here).

An embedding module whose optimizer runs in the lookup's backward (`kernels.embedding.TritonSparseEmbedding`,
``dlrm.model.fused_sparse.FusedUpdateSparseArch``) keeps ``weight.requires_grad`` False in that mode, so that no
optimizer, and not torch.compile's check against in-place updates of leaves that require grad, sees a trainable leaf;
a private zero-size tensor that requires grad (the "trigger") is an input of the lookup's autograd function instead, so
that autograd still runs its backward. `FusedUpdateSwitch` holds that plumbing once: the switch itself, and the
trigger kept on the weight's device across ``.to()`` / ``.cuda()``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


class FusedUpdateSwitch:
    """Mixin for an ``nn.Module`` with a ``weight`` parameter (listed before ``nn.Module`` among its bases).

    Sets ``fused_update`` (the optimizer config, or None) and ``_grad_trigger`` (a zero-size tensor that requires
    grad on the weight's device while the fused update is on, else None; a plain attribute, so the state_dict stays
    {"weight"}).

    Example:
        >>> from torch import nn
        >>> class Table(FusedUpdateSwitch, nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.zeros(4, 2))
        ...         self.fused_update, self._grad_trigger = None, None
        >>> t = Table()
        >>> t._switch_fused_update("sgd config")
        >>> t.weight.requires_grad, tuple(t._grad_trigger.shape), t._grad_trigger.requires_grad, list(t.state_dict())
        (False, (0,), True, ['weight'])
        >>> t._switch_fused_update(None)
        >>> t.weight.requires_grad, t._grad_trigger
        (True, None)
    """

    weight: Tensor
    fused_update: Any
    _grad_trigger: Optional[Tensor]

    def _switch_fused_update(self, config: Any) -> None:
        """The fused update on with ``config`` (the weight frozen, a fresh trigger) or off with None."""
        if config is not None:
            self.weight.requires_grad_(False)
            self._grad_trigger = self._new_trigger()
        else:
            self.weight.requires_grad_(True)
            self._grad_trigger = None
        self.fused_update = config

    def _new_trigger(self) -> Tensor:
        return torch.zeros(0, device=self.weight.device, requires_grad=True)

    def _apply(self, fn, *args, **kwargs):
        # Keep the trigger on weight's device across .to() / .cuda().
        out = super()._apply(fn, *args, **kwargs)  # nn.Module's, next in the subclass's MRO
        if self._grad_trigger is not None:
            self._grad_trigger = self._new_trigger()
        return out
