"""benchmarks/mlperf_dcnv2.py's baseline: issue #22's plain PyTorch DLRM-DCNv2 model. Moved out of mlperf_dcnv2.py
unchanged (the 600-line rule)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F_


class BaselineDCNv2(nn.Module):
    """Issue #22's plain PyTorch DLRM-DCNv2: one sparse ``nn.EmbeddingBag`` over all tables, eager MLPs
    and low-rank cross network (``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``).

    ``forward(dense [B, 13] fp32, raw [B, L] int64) -> logits [B] fp32``; the dense part under bf16
    autocast when ``precision == "bf16"`` (the embedding bag runs outside it, on its own dtype).

    >>> m = BaselineDCNv2([5, 7], [2, 1], 4, [8, 4], [6, 1], 2, 3, torch.device("cpu"), torch.float32, "fp32")
    >>> m(torch.randn(3, 13), torch.randint(-1, 100, (3, 3))).shape
    torch.Size([3])
    """

    def __init__(self, cardinalities: list[int], hotness: list[int], dim: int, bottom: list[int], top: list[int],
                 cross_layers: int, cross_rank: int, device: torch.device, emb_dtype: torch.dtype,
                 precision: str) -> None:
        super().__init__()
        F, L = len(cardinalities), sum(hotness)
        offsets = [0]
        for c in cardinalities[:-1]:
            offsets.append(offsets[-1] + c)
        self.num_features, self.num_slots, self.dim, self.precision = F, L, dim, precision
        self.emb = nn.EmbeddingBag(sum(cardinalities), dim, mode="sum", sparse=True, device=device, dtype=emb_dtype)
        with torch.no_grad():  # each table U(-sqrt(1/n), sqrt(1/n)), as the reference DLRM
            for off, c in zip(offsets, cardinalities):
                self.emb.weight[off:off + c].uniform_(-math.sqrt(1.0 / c), math.sqrt(1.0 / c))
        slot_card = [c for c, h in zip(cardinalities, hotness) for _ in range(h)]
        slot_off = [o for o, h in zip(offsets, hotness) for _ in range(h)]
        starts = [sum(hotness[:f]) for f in range(F)]
        self.register_buffer("slot_card", torch.tensor(slot_card, dtype=torch.int64, device=device))
        self.register_buffer("slot_off", torch.tensor(slot_off, dtype=torch.int64, device=device))
        self.register_buffer("slot_start", torch.tensor(starts, dtype=torch.int64, device=device))

        def mlp(n: int, widths: list[int], activate_last: bool) -> nn.Sequential:
            layers: list[nn.Module] = []
            for i, w in enumerate(widths):
                layers.append(nn.Linear(n, w, device=device))
                if activate_last or i < len(widths) - 1:
                    layers.append(nn.ReLU())
                n = w
            return nn.Sequential(*layers)

        n = (F + 1) * dim
        self.bottom = mlp(13, bottom, True)
        self.V = nn.ParameterList(nn.Parameter(nn.init.xavier_normal_(torch.empty(cross_rank, n, device=device)))
                                  for _ in range(cross_layers))
        self.W = nn.ParameterList(nn.Parameter(nn.init.xavier_normal_(torch.empty(n, cross_rank, device=device)))
                                  for _ in range(cross_layers))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(n, device=device)) for _ in range(cross_layers))
        self.top = mlp(n, top, False)

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if not name.startswith("emb.")]

    def forward(self, dense: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        B, L = raw.shape
        rows = torch.remainder(raw + 1, self.slot_card) + self.slot_off  # modulus hashing, per slot
        bag_offsets = (torch.arange(B, device=raw.device) * L).unsqueeze(1) + self.slot_start  # [B, F]
        emb = self.emb(rows.reshape(-1), bag_offsets.reshape(-1)).view(B, self.num_features * self.dim)
        autocast = torch.autocast(dense.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        with autocast:
            x = self.bottom(dense)
            x0 = torch.cat([x, emb.to(x.dtype)], dim=1)  # [B, (F+1) D], the dense vector first
            xl = x0
            for V, W, b in zip(self.V, self.W, self.b):
                xl = x0 * (F_.linear(F_.linear(xl, V), W, b)) + xl
            logits = self.top(xl)
        return logits.float().squeeze(1)
