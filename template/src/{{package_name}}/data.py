"""Token batches, the same at every world size, resumable from a position.

Each optimizer step reads one *global* batch, identified by its index. Every rank builds (or
reads) the same global batch and keeps its own contiguous slice, then splits that slice into
micro-batches. The loader's only state is the index of the next global batch, which does not
depend on the world size: a checkpoint taken on 2 ranks resumes exactly on 1 or 4.
"""

from __future__ import annotations

import torch

from .config import Config


class SyntheticTokens:
    """A random Markov chain in which every token has `branching` possible successors.

    Learnable by construction: the loss starts near ln(vocab_size) and can fall to
    ln(branching), so a falling loss shows the model, optimizer and sharding all work.
    """

    def __init__(self, vocab_size: int, seq_len: int, branching: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=g)

    def batch(self, index: int, size: int) -> torch.Tensor:
        """Global batch `index`: `size` sequences of seq_len + 1 tokens (inputs plus shifted targets)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.empty(size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (size,), generator=g)
        choices = torch.randint(self.successors.shape[1], (size, self.seq_len), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens


class TokenLoader:
    """This rank's micro-batches of each global batch, in order."""

    def __init__(self, source: SyntheticTokens, cfg: Config, rank: int, world_size: int, device: torch.device):
        t = cfg.train
        self.grad_accum_steps = grad_accum_steps(t.global_batch_size, t.micro_batch_size, world_size)
        self.source, self.device = source, device
        self.global_batch_size, self.micro_batch_size = t.global_batch_size, t.micro_batch_size
        self.per_rank = t.global_batch_size // world_size
        self.rank = rank
        self.position = 0

    def next_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per micro-batch of the next global batch."""
        tokens = self.source.batch(self.position, self.global_batch_size)
        self.position += 1
        mine = tokens[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        mine = mine.to(self.device, non_blocking=True)
        return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(self.micro_batch_size)]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def grad_accum_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per step; the global batch must split evenly."""
    per_rank, rest = divmod(global_batch_size, world_size)
    if rest or per_rank % micro_batch_size:
        raise ValueError(
            f"train.global_batch_size={global_batch_size} does not split into {world_size} ranks x "
            f"micro-batches of train.micro_batch_size={micro_batch_size}; make it a multiple of "
            f"{world_size * micro_batch_size}"
        )
    return per_rank // micro_batch_size


def build_loader(cfg: Config, rank: int, world_size: int, device: torch.device) -> TokenLoader:
    source = SyntheticTokens(cfg.model.vocab_size, cfg.train.seq_len, cfg.data.synthetic_branching, cfg.train.seed)
    return TokenLoader(source, cfg, rank, world_size, device)
