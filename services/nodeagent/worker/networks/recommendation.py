"""NCF's NeuMF over user and item ids."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor, nn


class NeuMF(nn.Module):
    """NCF's NeuMF: a matrix-factorisation and an MLP path over user and item embeddings.
    Input: ``B x 2`` (user, item) ids; output: one logit per pair."""

    def __init__(self, users: int, items: int, mlp: Sequence[int], factors: int = 64) -> None:
        super().__init__()
        self.users, self.items = users, items
        self.mf_user, self.mf_item = nn.Embedding(users, factors), nn.Embedding(items, factors)
        half = mlp[0] // 2
        self.mlp_user, self.mlp_item = nn.Embedding(users, half), nn.Embedding(items, half)
        layers: list[nn.Module] = []
        for cin, cout in itertools.pairwise(mlp):
            layers += [nn.Linear(cin, cout), nn.ReLU(inplace=True)]
        self.mlp = nn.Sequential(*layers)
        self.predict = nn.Linear(factors + mlp[-1], 1)

    def forward(self, pairs: Tensor) -> Tensor:
        user, item = pairs[:, 0], pairs[:, 1]
        mf = self.mf_user(user) * self.mf_item(item)
        mlp = self.mlp(torch.cat([self.mlp_user(user), self.mlp_item(item)], dim=1))
        return self.predict(torch.cat([mf, mlp], dim=1)).squeeze(1)
