"""The ``residual_mlp`` backbone: flatten, a linear layer to ``width`` units, then ``blocks``
residual blocks x + ReLU(W x). The trainer adds the head the loss needs on top."""

from __future__ import annotations

import math

from torch import nn


class ResidualMLP(nn.Module):
    def __init__(self, input_shape: tuple, width: int = 64, blocks: int = 2):
        super().__init__()
        self.inp = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.out_features = width

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x).relu()
        return x
