"""DeepSpeech2, as deepspeech.pytorch defines it: spectrogram frames in, character
logits per output frame out."""

from __future__ import annotations

from torch import Tensor, nn

from gpusched.services.nodeagent.worker.registry import SPECTROGRAM_BINS

SPEECH_CHARACTERS = 29


class SequenceNorm(nn.Module):
    """Batch normalisation over every (sample, frame) of a ``B x T x H`` sequence."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.flatten(0, 1)).view_as(x)


class BidirectionalLayer(nn.Module):
    """deepspeech.pytorch's BatchRNN: optional sequence norm, a bidirectional LSTM whose
    two directions are summed."""

    def __init__(self, cin: int, width: int, norm: bool) -> None:
        super().__init__()
        self.norm: nn.Module = SequenceNorm(cin) if norm else nn.Identity()
        self.lstm = nn.LSTM(cin, width, bidirectional=True, batch_first=True)
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.norm(x))
        return out[..., : self.width] + out[..., self.width :]


class DeepSpeech2(nn.Module):
    """deepspeech.pytorch's DeepSpeech2 (its defaults: LSTM, 5 layers of 1024, 161 bins).
    Output: per-frame character logits, ``B x frames/2 x 29``."""

    def __init__(self, width: int = 1024, layers: int = 5) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, (41, 11), (2, 2), (20, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20),
            nn.Conv2d(32, 32, (21, 11), (2, 1), (10, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20),
        )  # fmt: skip
        bins = (SPECTROGRAM_BINS + 40 - 41) // 2 + 1
        bins = (bins + 20 - 21) // 2 + 1
        self.rnns = nn.Sequential(
            BidirectionalLayer(32 * bins, width, norm=False),
            *(BidirectionalLayer(width, width, norm=True) for _ in range(layers - 1)),
        )
        self.head = nn.Sequential(
            SequenceNorm(width), nn.Linear(width, SPEECH_CHARACTERS, bias=False)
        )

    def forward(self, spectrogram: Tensor) -> Tensor:
        features = self.conv(spectrogram)  # B x 32 x bins x frames
        sequence = features.flatten(1, 2).transpose(1, 2)  # B x frames x 32*bins
        return self.head(self.rnns(sequence))


def speech_frames(frames: int) -> int:
    """Output frames of DeepSpeech2 for ``frames`` input frames (the first conv halves them)."""
    return (frames + 2 * 5 - 11) // 2 + 1
