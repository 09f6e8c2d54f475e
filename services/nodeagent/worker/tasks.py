"""What each real architecture trains on and its loss: synthetic labelled batches made
from the input pipeline's images (sample ``p`` a function of (seed, p), targets from
fixed random "teachers" seeded with the seed alone), the loss, and what accuracy counts.
One task per kind of network (networks/)."""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor
from torch.nn import functional

from gpusched.services.nodeagent.worker.networks.atari import ATARI_ACTIONS
from gpusched.services.nodeagent.worker.networks.language import (
    BERT_MASK_TOKEN,
    BERT_VOCABULARY,
    TRANSLATION_VOCABULARY,
)
from gpusched.services.nodeagent.worker.networks.speech import SPEECH_CHARACTERS, speech_frames
from gpusched.services.nodeagent.worker.networks.vision import yolo_cells
from gpusched.services.nodeagent.worker.pipeline import IMAGE_SIZE, RECORD_CHANNELS

IGNORE = -100

_SEED_MIX = 0x9E3779B97F4A7C15


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _SEED_MIX + 7919 * stream + 1) % 2**63)


class Task(Protocol):
    """A real architecture's synthetic data and loss."""

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of a batch of pipeline images, on the CPU."""
        ...

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor: ...

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        """How many of the predictions that accuracy counts are right, out of how many."""
        ...


POOLED = 4
PIXELS = RECORD_CHANNELS * IMAGE_SIZE**2


def _pooled(images: Tensor) -> Tensor:
    return functional.adaptive_avg_pool2d(images, POOLED).flatten(1)


def _projected(images: Tensor, projection: Tensor) -> Tensor:
    """Roughly standard normal features of each image, one per column of ``projection``."""
    return images.flatten(1) @ projection / math.sqrt(PIXELS)


def argmax_correct(logits: Tensor, targets: Tensor) -> tuple[float, int]:
    return float((logits.argmax(dim=-1) == targets).sum()), targets.numel()


class ImageClassification:
    """Classes from a teacher over the pooled image; with auxiliary heads (GoogLeNet,
    Inception) the loss adds theirs at ``aux_weight``."""

    def __init__(self, seed: int, classes: int, aux_weight: float = 0.0) -> None:
        self.classes, self.aux_weight = classes, aux_weight
        self.teacher = torch.randn(
            RECORD_CHANNELS * POOLED**2, classes, generator=_generator(seed, 1)
        )

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        return images, (_pooled(images) @ self.teacher).argmax(dim=1)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        main, *auxiliary = outputs.split(self.classes, dim=1)
        loss = functional.cross_entropy(main, targets)
        for logits in auxiliary:
            loss = loss + self.aux_weight * functional.cross_entropy(logits, targets)
        return loss

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        return argmax_correct(outputs[:, : self.classes], targets)


class Detection:
    """YOLO targets per anchor cell (objectness, class, box in 0..1): ``objects`` cells of
    each image hold an object. The loss: objectness BCE over every cell, class cross entropy
    and box MSE over the cells with an object."""

    def __init__(self, seed: int, classes: int, size: int, objects: int = 4) -> None:
        self.classes, self.cells = classes, yolo_cells(size)
        generator = _generator(seed, 2)
        self.where = torch.randn(PIXELS, objects, generator=generator)
        self.boxes = torch.randn(PIXELS, 4 * objects, generator=generator)
        self.teacher = torch.randn(
            RECORD_CHANNELS * POOLED**2, objects * classes, generator=generator
        )

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        batch = images.shape[0]
        cells = (_projected(images, self.where).abs() * 1e4).long() % self.cells
        objects = cells.shape[1]
        classes = (_pooled(images) @ self.teacher).view(batch, objects, -1).argmax(dim=2)
        boxes = torch.sigmoid(_projected(images, self.boxes)).view(batch, objects, 4)
        targets = torch.zeros(batch, self.cells, 6)
        rows = torch.arange(batch)[:, None].expand(batch, objects)
        targets[rows, cells] = torch.cat(
            [torch.ones(batch, objects, 1), classes[..., None].float(), boxes], dim=2
        )
        return images, targets

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        present = targets[..., 0] > 0
        objectness = functional.binary_cross_entropy_with_logits(outputs[..., 4], targets[..., 0])
        found, wanted = outputs[present], targets[present]
        boxes = functional.mse_loss(torch.sigmoid(found[:, :4]), wanted[:, 2:])
        classes = functional.cross_entropy(found[:, 5:], wanted[:, 1].long())
        return objectness + boxes + classes

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        present = targets[..., 0] > 0
        return argmax_correct(outputs[present][:, 5:], targets[present][:, 1].long())


def _token_walk(images: Tensor, projection: Tensor, vocabulary: int, step: int) -> Tensor:
    """Token sequences in which each token is its predecessor plus ``step`` plus 0..2,
    from a start and the increments drawn from the image (``length`` = projection columns)."""
    features = _projected(images, projection)
    start = (features[:, :1].abs() * vocabulary).long()
    increments = step + (features[:, 1:] > 0).long() + (features[:, 1:] > 1).long()
    return torch.cat([start, start + increments.cumsum(dim=1)], dim=1) % vocabulary


class CausalLanguageModel:
    """Next-token prediction over ``length`` tokens."""

    def __init__(self, seed: int, vocabulary: int, length: int) -> None:
        self.vocabulary = vocabulary
        self.projection = torch.randn(PIXELS, length + 1, generator=_generator(seed, 3))

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        tokens = _token_walk(images, self.projection, self.vocabulary, 7)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return functional.cross_entropy(outputs.reshape(-1, self.vocabulary), targets.reshape(-1))

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        return argmax_correct(outputs, targets)


class MaskedLanguageModel(CausalLanguageModel):
    """BERT's masked-LM: about 15 % of the tokens (at least one per sequence) are replaced
    by [MASK]; targets are the originals there and ignored elsewhere."""

    def __init__(self, seed: int, length: int) -> None:
        super().__init__(seed, BERT_VOCABULARY, length)
        self.masked = torch.rand(PIXELS, length, generator=_generator(seed, 4))

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        tokens = _token_walk(images, self.projection, self.vocabulary, 7)[:, :-1]
        masked = _projected(images, self.masked).abs() % 1.0 < 0.15
        masked[:, 1] = True
        targets = torch.where(masked, tokens, IGNORE)
        return torch.where(masked, BERT_MASK_TOKEN, tokens), targets

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        counted = targets != IGNORE
        return argmax_correct(outputs[counted], targets[counted])


class Translation(CausalLanguageModel):
    """A source sequence and its "translation" (reversed, each token mapped); the decoder
    reads the target shifted right behind a start token. Label smoothing 0.1, as the
    Transformer paper trains."""

    def __init__(self, seed: int, length: int) -> None:
        super().__init__(seed, TRANSLATION_VOCABULARY, length - 1)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        source = _token_walk(images, self.projection, self.vocabulary, 3)
        target = (source.flip(1) * 5 + 2) % self.vocabulary
        decoder = functional.pad(target[:, :-1], (1, 0), value=1)
        return torch.cat([source, decoder], dim=1), target

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return functional.cross_entropy(
            outputs.reshape(-1, self.vocabulary), targets.reshape(-1), label_smoothing=0.1
        )


class SpeechRecognition:
    """CTC over the frames of the network's output: each image's transcript is
    ``frames/4`` of its output frames' worth of characters (1..28; 0 is the blank)."""

    def __init__(self, seed: int, frames: int) -> None:
        self.frames = speech_frames(frames)
        self.length = max(1, self.frames // 4)
        self.projection = torch.randn(PIXELS, self.length, generator=_generator(seed, 5))

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        features = _projected(images, self.projection)
        return images, 1 + (features.abs() * 100).long() % (SPEECH_CHARACTERS - 1)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        batch, frames = outputs.shape[:2]
        log_probs = functional.log_softmax(outputs, dim=2).transpose(0, 1)
        return functional.ctc_loss(
            log_probs, targets,
            torch.full((batch,), frames, dtype=torch.long),
            torch.full((batch,), targets.shape[1], dtype=torch.long),
            zero_infinity=True,
        )  # fmt: skip

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        """Characters of the greedy decoding at their place in the transcript."""
        right = 0.0
        for best, transcript in zip(outputs.argmax(dim=2), targets, strict=True):
            decoded = torch.unique_consecutive(best)
            decoded = decoded[decoded != 0][: transcript.numel()]
            right += float((decoded == transcript[: decoded.numel()]).sum())
        return right, targets.numel()


class Recommendation:
    """(user, item) pairs drawn from the image; a pair is positive when the teacher's user
    and item scores sum above 0. Binary cross entropy on the logit."""

    def __init__(self, seed: int, users: int, items: int) -> None:
        generator = _generator(seed, 6)
        self.users, self.items = users, items
        self.projection = torch.randn(PIXELS, 2, generator=generator)
        self.user_score = torch.randn(users, generator=generator)
        self.item_score = torch.randn(items, generator=generator)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        draws = (_projected(images, self.projection).abs() * 1e6).long()
        pairs = torch.stack([draws[:, 0] % self.users, draws[:, 1] % self.items], dim=1)
        positive = self.user_score[pairs[:, 0]] + self.item_score[pairs[:, 1]] > 0
        return pairs, positive.float()

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return functional.binary_cross_entropy_with_logits(outputs, targets)

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        return float(((outputs > 0).float() == targets).sum()), targets.numel()


class Reinforcement:
    """Atari-like transitions: the teacher's action and its return for each frame stack
    (targets ``B x 2``). DQN: Huber loss of Q(s, a) against the return; A2C: policy
    gradient with the advantage, value regression and an entropy bonus."""

    def __init__(self, seed: int, actor_critic: bool) -> None:
        self.actor_critic = actor_critic
        generator = _generator(seed, 7)
        pooled = RECORD_CHANNELS * POOLED**2
        self.actions = torch.randn(pooled, ATARI_ACTIONS, generator=generator)
        self.returns = torch.randn(pooled, 1, generator=generator)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        pooled = _pooled(images)
        action = (pooled @ self.actions).argmax(dim=1, keepdim=True).float()
        value = torch.tanh(pooled @ self.returns)
        return images, torch.cat([action, value], dim=1)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        action, value = targets[:, 0].long(), targets[:, 1]
        if not self.actor_critic:
            chosen = outputs.gather(1, action[:, None]).squeeze(1)
            return functional.smooth_l1_loss(chosen, value)
        logits, estimate = outputs[:, :-1], outputs[:, -1]
        log_policy = functional.log_softmax(logits, dim=1)
        advantage = (value - estimate).detach()
        policy = -(log_policy.gather(1, action[:, None]).squeeze(1) * advantage).mean()
        entropy = -(log_policy.exp() * log_policy).sum(dim=1).mean()
        return policy + 0.5 * functional.mse_loss(estimate, value) - 0.01 * entropy

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        """A2C: the policy's best action is the teacher's; DQN: Q(s, a) within 0.1 of the
        return."""
        action, value = targets[:, 0].long(), targets[:, 1]
        if self.actor_critic:
            return argmax_correct(outputs[:, :-1], action)
        chosen = outputs.gather(1, action[:, None]).squeeze(1)
        return float(((chosen - value).abs() < 0.1).sum()), value.numel()
