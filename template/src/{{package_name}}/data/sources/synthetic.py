"""data.source = "synthetic": learnable tokens generated from the seed, no files (the debug config's data)."""

from __future__ import annotations

import torch

from ...config import DataConfig, TrainConfig
from ..order import seeded_generator
from .spec import Batch, SourceSpec, generated_stream


class SyntheticTokens:
    """A random Markov chain in which every token has `branching` possible successors.

    Learnable by construction: the loss starts near ln(vocab_size) and can fall to
    ln(branching), so a falling loss shows the model, optimizer and sharding all work.
    """

    def __init__(self, vocab_size: int, seq_len: int, branching: int, seed: int, held_out: bool = False):
        self.vocab_size, self.seq_len, self.seed, self.held_out = vocab_size, seq_len, seed, held_out
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=seeded_generator(seed, -1))

    def batch(self, index: int, size: int) -> Batch:
        g = seeded_generator(self.seed, generated_stream(index, self.held_out))
        tokens = torch.empty(size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (size,), generator=g)
        choices = torch.randint(self.successors.shape[1], (size, self.seq_len), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


def synthetic_tokens(*, data: DataConfig, train: TrainConfig, model, held_out: bool = False, **_) -> SyntheticTokens:
    """The chain of data.synthetic_branching successors over the model's vocabulary; validation's batches are
    random streams that training never draws."""
    return SyntheticTokens(model.vocab_size, train.seq_len, data.synthetic_branching, train.seed, held_out=held_out)


SPEC = SourceSpec(build=synthetic_tokens, held_out=lambda **sections: synthetic_tokens(**sections, held_out=True))
