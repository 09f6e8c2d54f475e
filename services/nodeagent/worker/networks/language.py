"""Token networks: BERT-base with its masked-LM head, GPT-2 small, the Transformer base
and PyTorch's LSTM language model."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional

BERT_VOCABULARY, BERT_POSITIONS, BERT_MASK_TOKEN = 30_522, 512, 103
GPT2_VOCABULARY, GPT2_POSITIONS = 50_257, 1024
TRANSLATION_VOCABULARY = 37_000


def _encoder(width: int, heads: int, layers: int, ff: int, *, pre_norm: bool,
             eps: float) -> nn.TransformerEncoder:  # fmt: skip
    layer = nn.TransformerEncoderLayer(
        width, heads, ff, dropout=0.1, activation="gelu", layer_norm_eps=eps,
        batch_first=True, norm_first=pre_norm,
    )  # fmt: skip
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _init_like_bert(
    module: nn.Module, std: float = 0.02, *, scaled: tuple[str, ...] = (), layers: int = 1
) -> None:
    """BERT's and GPT-2's initialisation: weights normal (std 0.02), biases 0, norms 1;
    weights whose name ends in ``scaled`` (GPT-2's residual projections) by 1/sqrt(2 layers)."""
    for name, parameter in module.named_parameters():
        if parameter.dim() == 1:
            nn.init.ones_(parameter) if "norm" in name else nn.init.zeros_(parameter)
        else:
            factor = (2 * layers) ** -0.5 if name.endswith(scaled) else 1.0
            nn.init.normal_(parameter, std=std * factor)


class Bert(nn.Module):
    """BERT-base with its masked-LM head (the decoder tied to the token embedding). A
    sequence is two segments of half its length."""

    def __init__(self) -> None:
        super().__init__()
        width = 768
        self.tokens = nn.Embedding(BERT_VOCABULARY, width)
        self.positions = nn.Embedding(BERT_POSITIONS, width)
        self.segments = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.encoder = _encoder(width, 12, 12, 3072, pre_norm=False, eps=1e-12)
        self.transform = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width, eps=1e-12)
        )
        self.bias = nn.Parameter(torch.zeros(BERT_VOCABULARY))
        _init_like_bert(self)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        where = torch.arange(length, device=tokens.device)
        segment = (where >= length // 2).long()
        hidden = self.tokens(tokens) + self.positions(where) + self.segments(segment)
        hidden = self.encoder(self.dropout(self.norm(hidden)))
        return functional.linear(self.transform(hidden), self.tokens.weight, self.bias)


class Gpt2(nn.Module):
    """GPT-2 small: pre-norm causal blocks, learned positions, LM head tied to the tokens."""

    def __init__(self) -> None:
        super().__init__()
        width = 768
        self.tokens = nn.Embedding(GPT2_VOCABULARY, width)
        self.positions = nn.Embedding(GPT2_POSITIONS, width)
        self.dropout = nn.Dropout(0.1)
        self.blocks = _encoder(width, 12, 12, 4 * width, pre_norm=True, eps=1e-5)
        self.norm = nn.LayerNorm(width)
        _init_like_bert(self, scaled=("out_proj.weight", "linear2.weight"), layers=12)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        where = torch.arange(length, device=tokens.device)
        hidden = self.dropout(self.tokens(tokens) + self.positions(where))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return functional.linear(self.norm(hidden), self.tokens.weight)


def sinusoids(length: int, width: int) -> Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    rate = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(1e4) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)
    return table


class TranslationTransformer(nn.Module):
    """The Transformer base: shared source/target embedding tied to the output projection,
    sinusoidal positions. Its input is the source tokens followed by the decoder's input
    (the target shifted right), each ``length`` long."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.width = 512
        self.embedding = nn.Embedding(TRANSLATION_VOCABULARY, self.width)
        self.register_buffer("positions", sinusoids(length, self.width), persistent=False)
        self.transformer = nn.Transformer(self.width, 8, 6, 6, 2048, dropout=0.1, batch_first=True)
        nn.init.normal_(self.embedding.weight, std=self.width**-0.5)

    def _embed(self, tokens: Tensor) -> Tensor:
        positions = self.get_buffer("positions")
        return self.embedding(tokens) * math.sqrt(self.width) + positions[: tokens.shape[1]]

    def forward(self, pair: Tensor) -> Tensor:
        source, target = pair.chunk(2, dim=1)
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1], device=pair.device)
        hidden = self.transformer(
            self._embed(source), self._embed(target), tgt_mask=mask, tgt_is_causal=True
        )
        return functional.linear(hidden, self.embedding.weight)


LM_VOCABULARY = 33_278


class LstmLanguageModel(nn.Module):
    """PyTorch's word_language_model (LSTM, 2 layers of 200, dropout 0.2, untied)."""

    def __init__(self, width: int = 200, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(LM_VOCABULARY, width)
        self.dropout = nn.Dropout(0.2)
        self.lstm = nn.LSTM(width, width, layers, dropout=0.2, batch_first=True)
        self.decoder = nn.Linear(width, LM_VOCABULARY)
        for weight in (self.embedding.weight, self.decoder.weight):
            nn.init.uniform_(weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden, _ = self.lstm(self.dropout(self.embedding(tokens)))
        return self.decoder(self.dropout(hidden))
