"""Independent torch re-statements of SpecForge's DSpine semantics, shared by the test modules.

Written from docs/ARCHITECTURE.md §2.2–2.4 and SpecForge's ``AdjacentInjection`` / ``refine`` /
``transition_scores`` / ``OnlineDSpineModel._objective_terms`` semantics, on torch-layout (``[out, in]``)
tensors named as in a checkpoint, so nothing here calls ``dspine_jax``. Import it after ``require("torch")``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def torch_transfer_space(head: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 PCA of the L2-normalised head rows ``[V, H]`` → codes ``[V, R]``, directions ``[H, R]``."""
    normalized = F.normalize(head.double(), dim=-1)
    mean = normalized.mean(0)
    cov = normalized.T @ normalized - head.shape[0] * torch.outer(mean, mean)
    values, directions = torch.linalg.eigh(cov)
    values, directions = values[-rank:], directions[:, -rank:]
    codes = F.normalize((normalized - mean) @ directions / values.sqrt(), dim=-1)
    return codes.float(), directions.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class TorchInjection:
    """Adjacent causal injection + last-write refinement from checkpoint tensors ``w``."""

    def __init__(self, w: dict[str, torch.Tensor], codes: torch.Tensor, norm) -> None:
        self.w, self.codes, self.norm = w, codes, norm
        self.rank = codes.shape[1]

    def feature(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        return math.sqrt(self.rank) * F.normalize(h @ self.w[f"injection.readouts.{layer}.weight"].T, dim=-1)

    def code(self, ids: torch.Tensor) -> torch.Tensor:
        return math.sqrt(self.rank) * self.codes[ids]

    def write(self, h: torch.Tensor, receiver: torch.Tensor, pred: torch.Tensor, layer: int) -> torch.Tensor:
        w = self.w
        gate = torch.sigmoid(
            receiver @ w["injection.receiver_gate.weight"].T
            + pred @ w["injection.predecessor_gate.weight"].T
            + w["injection.bias"]
        )
        delta = (gate * (pred @ w["injection.message.weight"].T)) @ w[f"injection.writes.{layer}.weight"].T
        return h + torch.linalg.vector_norm(h, dim=-1, keepdim=True) / math.sqrt(h.shape[-1]) * delta

    def inject(self, h: torch.Tensor, layer: int, anchor: torch.Tensor) -> torch.Tensor:
        f = self.feature(h, layer)
        pred = torch.cat([self.code(anchor)[:, None], f[:, 1:-1]], dim=1)
        return torch.cat([h[:, :1], self.write(h[:, 1:], f[:, 1:], pred, layer)], dim=1)

    def refine(self, pre: torch.Tensor, pred_ids: torch.Tensor, last: int) -> torch.Tensor:
        return self.norm(self.write(pre, self.feature(pre, last), self.code(pred_ids), last))
