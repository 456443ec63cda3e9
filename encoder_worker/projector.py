"""Projector: vision features [K, D_vision] -> language-model embeddings [K, hidden].

LLaVA's two-layer MLP (Linear, GELU, Linear) with seeded synthetic weights. When `target_rms`
is given, every output token is rescaled to that RMS so visual tokens sit on the scale of the
language model's own token embeddings, whatever the tower's activations look like.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ("Projector",)


class Projector(nn.Module):
    def __init__(
        self, vision_size: int, hidden_size: int, seed: int, target_rms: float | None
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        self.target_rms = target_rms
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        with torch.no_grad():
            self.fc1.weight.normal_(0.0, 1.0 / math.sqrt(vision_size), generator=g)
            self.fc2.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size), generator=g)
            self.fc1.bias.zero_()
            self.fc2.bias.zero_()

    @staticmethod
    def describe(vision_size: int, hidden_size: int, target_rms: float | None) -> str:
        return f"ln+mlp2x_gelu:{vision_size}->{hidden_size}:rms={target_rms}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [K, D_vision] -> [K, hidden] float32."""
        # tower features can be large; normalize per token so the random MLP sees unit scale
        x = F.layer_norm(x.float(), x.shape[-1:])
        y = self.fc2(F.gelu(self.fc1(x.to(self.fc1.weight.dtype)))).float()  # [K, hidden]
        if self.target_rms is not None:
            rms = y.square().mean(dim=-1, keepdim=True).sqrt().clamp(min=1e-6)
            y = y * (self.target_rms / rms)
        return y
