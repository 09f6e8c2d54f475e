"""The Atari agents' networks: the Nature CNN with DQN's action values, and A2C's policy
and value heads."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gpusched.services.nodeagent.worker.registry import ATARI_FRAMES

ATARI_ACTIONS = 18


def nature_cnn() -> list[nn.Module]:
    return [
        nn.Conv2d(ATARI_FRAMES, 32, 8, 4), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 4, 2), nn.ReLU(inplace=True),
        nn.Conv2d(64, 64, 3, 1), nn.ReLU(inplace=True), nn.Flatten(),
        nn.Linear(64 * 7 * 7, 512), nn.ReLU(inplace=True),
    ]  # fmt: skip


class ActorCritic(nn.Module):
    """Output: the policy's action logits and the state's value, ``B x (actions + 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*nature_cnn())
        self.policy, self.value = nn.Linear(512, ATARI_ACTIONS), nn.Linear(512, 1)

    def forward(self, frames: Tensor) -> Tensor:
        hidden = self.trunk(frames)
        return torch.cat([self.policy(hidden), self.value(hidden)], dim=1)
