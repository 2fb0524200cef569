"""The model contract: what a model module declares so the rest of the repo needs no per-model code.

Each model module defines its hyperparameters (a dataclass extending `ModelConfig`: the `[model]`
table of a config that names it) and `SPEC = ModelSpec(...)`; models/__init__.py maps
`model.name` to the module. From the spec, config/ types and checks `[model]` (`config`),
plan/ sizes memory and metrics.py counts FLOPs (`shape`: sizes and cost terms), data/ feeds `inputs`,
weights.py maps the weights to and from Hugging Face (`hf`, a state-dict adapter, which also declares
the config.json fields that change what the model computes), models/lora.py places adapters
(`lora`), parallelize.py splits the model for tensor parallelism (`tp_plan`) and its sequences for
context parallelism (`cp_plan`), and generate.py keeps its keys and values between tokens
(`kv_cache`, a KVCache). The nn.Module it
builds meets the module contract in models/__init__.py. Plain Python and torch: nothing here
imports torch.distributed, or the rest of the repo (config/ imports the models, never the other
way round).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, NamedTuple, TypeVar

import torch
from torch import nn

from .config_math import ConfigMath, read_config_json


@dataclass
class ModelConfig:
    """What every model's `[model]` table holds. A model module extends it with its own hyperparameters,
    each with a default and one line of documentation (its `--help` text), and refuses the values it
    cannot take in `errors`."""

    name: str
    """Model family; models/__init__.py maps it to the module that defines it."""
    preset: str = "debug"
    """Name of the size preset these shapes came from (informational)."""

    def errors(self, seq_len: int) -> list[str]:
        """Every reason this model cannot be built, or trained on `seq_len` tokens per sample (empty when it can)."""
        return []

    def parallel_errors(self, parallel) -> list[str]:
        """Every setting of `parallel` (the `[parallel]` section, config.ParallelConfig, read by attribute: models/
        never imports config/) this model cannot be trained with, naming why. A model without experts has
        nothing for expert parallelism to split."""
        degree = getattr(parallel, "expert_parallel", 1)
        if degree > 1:
            return [f"parallel.expert_parallel={degree}: model.name={self.name} has no experts to split among ranks; "
                    "set parallel.expert_parallel=1"]  # fmt: skip
        return []


C = TypeVar("C", bound=ModelConfig)


class Linear(NamedTuple):
    """One linear layer of a block."""

    group: Literal["attention", "mlp"]
    """The part of the block it is in, as finetune.lora_targets names them."""
    inputs: int
    """Input features."""
    outputs: int
    """Output features."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner (plan/) and the MFU figure (metrics.py) know of a model: its sizes, and its cost terms.

    A model module subclasses it to declare what its blocks keep for backward (`activation_bytes`),
    and, where the transformer count does not fit, its FLOPs (`flops_per_token`); tests/test_plan.py
    measures the activations of every model in the registry against the declaration.
    """

    P: int
    """Parameters in all."""
    Pb: int
    """Parameters per block (one FSDP unit)."""
    Pn: int
    """Parameters outside the blocks (embeddings, final norm, head)."""
    L: int
    """Blocks."""
    h: int
    """Hidden size."""
    kv: int
    """Key/value width (heads x head size)."""
    f: int
    """Feed-forward hidden size."""
    V: int
    """Output classes: the vocabulary of a language model."""
    tokens: int = 0
    """Tokens per sample through the blocks (0: train.seq_len)."""
    logits: int = 0
    """Positions per sample that produce logits (0: every token)."""
    linears: tuple[Linear, ...] = ()
    """The linear layers of a block: LoRA's adapters, float8's all-gathers and the largest tensor read them."""
    lookups: int = 0
    """Parameters that are read by index, not multiplied (an embedding other than a tied head): no FLOPs."""
    kv_heads: int = 0
    """Key/value heads of attention (0: none declared); context parallelism repeats them where its degree does not
    divide them."""
    experts: int = 0
    """Routed experts per sparse layer of a mixture of experts (0: a dense model); expert parallelism splits them."""
    expert_params: int = 0
    """Parameters of one routed expert in one layer: what expert parallelism places, expert by expert."""
    top_k: int = 0
    """Experts each token is routed to (0: a dense model)."""
    sparse_layers: int = 0
    """Blocks that are mixtures of experts."""
    active: int = 0
    """Parameters one token is multiplied by where fewer than P (a mixture of experts); 0: every one of P."""

    @property
    def active_params(self) -> int:
        """Parameters one token is multiplied by: the compute of a step counts these (6 FLOPs each a token)."""
        return self.active or self.P

    @property
    def routed_params(self) -> int:
        """Routed experts' parameters in one sparse block: the part of Pb that expert parallelism splits."""
        return self.experts * self.expert_params

    def activation_bytes(
        self, p: int, ac: str, *, lora_rank: int = 0, lora_targets: str = "all", tensor_parallel: int = 1,
        sequence_parallel: bool = True, context_parallel: int = 1,
    ) -> float:  # fmt: skip
        """Bytes one block keeps for backward per token a rank holds: `p` bytes per element of the compute dtype,
        activation checkpointing `ac` (none, selective, full), LoRA adapters of `lora_rank` (0: none) on
        `lora_targets`, tensor parallelism of `tensor_parallel` ranks, with or without sequence parallelism, and
        context parallelism of `context_parallel` ranks (each holding that share of every sequence's tokens)."""
        raise NotImplementedError(f"{type(self).__name__} declares no activation bytes: subclass ModelShape")

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, torchtitan's convention: 6 x the multiplied parameters, plus attention's
        12 x blocks x hidden size x `seq_len` (2 matmuls, x3 for forward and backward, x2 for multiply-add),
        ignoring causal sparsity as is customary."""
        return 6 * (self.P - self.lookups) + 12 * self.L * self.h * seq_len

    def adapted(self, targets: str) -> tuple[Linear, ...]:
        """The linear layers of a block that LoRA adapts with finetune.lora_targets = `targets`."""
        return tuple(layer for layer in self.linears if targets in ("all", layer.group))

    def adapter_params(self, rank: int, targets: str) -> int:
        """LoRA parameters per block: rank x (in + out) for each adapted layer (0 for rank 0)."""
        return sum(rank * (layer.inputs + layer.outputs) for layer in self.adapted(targets))

    @property
    def linear_params(self) -> int:
        """Weights of a block's linear layers (the rest of the block: norms, biases)."""
        return sum(layer.inputs * layer.outputs for layer in self.linears)

    @property
    def largest(self) -> int:
        """Elements of the largest tensor: the embedding or head (V x h), or a block's widest layer."""
        return max([self.V * self.h, *(layer.inputs * layer.outputs for layer in self.linears)])


StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RenameTable:
    """Parameter names of this repo beside a Hugging Face layout's, one pattern pair per row.

    Patterns hold `{field}` placeholders; `fields` gives the regular expression each stands for,
    e.g. `("layers.{i}.attention.w{x}.weight", "model.layers.{i}.self_attn.{x}_proj.weight")`.
    `to_hf` and `from_hf` are the state-dict adapter (HFLayout) of a layout that only renames.
    """

    rows: tuple[tuple[str, str], ...]
    fields: tuple[tuple[str, str], ...] = (("i", r"\d+"),)

    def rename(self, name: str, *, to_hf: bool) -> str:
        for ours, theirs in self.rows:
            source, target = (ours, theirs) if to_hf else (theirs, ours)
            pattern = re.escape(source)
            for field, regex in self.fields:
                placeholder = re.escape("{" + field + "}")
                pattern = pattern.replace(placeholder, f"(?P<{field}>{regex})")
            if match := re.fullmatch(pattern, name):
                return target.format(**match.groupdict())
        raise ValueError(f"no {'Hugging Face' if to_hf else 'repo'} name for parameter {name!r}")

    def to_hf(self, state: StateDict, cfg: ModelConfig | None = None) -> StateDict:
        """`state` under the Hugging Face names: the same tensors (a renaming needs no hyperparameter of `cfg`)."""
        return {self.rename(k, to_hf=True): v for k, v in state.items()}

    def from_hf(self, state: StateDict, cfg: ModelConfig | None = None) -> StateDict:
        """A Hugging Face state dict under this repo's names: the same tensors."""
        return {self.rename(k, to_hf=False): v for k, v in state.items()}


@dataclass(frozen=True)
class HFLayout(Generic[C]):
    """How a model's weights map onto a Hugging Face transformers checkpoint (checkpoint.init_from, export=hf).

    `to_hf` and `from_hf` are a state-dict adapter: functions over tensors, inverse to each other,
    that may rename, transpose, permute, fuse or split, so a model keeps the layout it computes with
    and still reads and writes the Hugging Face one. They receive the model's config too, for the
    layouts that depend on a hyperparameter (a fused `query_key_value` laid out head by head needs the
    head size). weights.py calls them on full tensors and on this rank's shards (DTensors) alike: an
    export writes `to_hf` of the sharded weights, and `checkpoint.init_from` reads into `to_hf` of
    them, then sets the model from `from_hf` of what it read (torchtitan's order). So they use torch
    ops, which DTensor runs shard by shard: a transpose or a slice is a view of the shards, while
    concatenating along the dimension FSDP splits (Shard(0)) gathers the tensor whole on every rank.
    They map every key of the model's state dict, a tied head's too (weights.py leaves its copy out of
    the files). A LoRA export writes a PEFT adapter for every adapted layer that `to_hf` only renames.

    `config_math` declares which config.json fields change what the model computes and which [model]
    key sets each (models/config_math.py): checkpoint.init_from compares a checkpoint's config.json
    with `config_json`'s on those fields, and a refusal names the model's own key.
    """

    to_hf: Callable[[StateDict, C], StateDict]
    """This repo's state dict -> the transformers one (names, and where they differ, layouts), for the model of `C`."""
    from_hf: Callable[[StateDict, C], StateDict]
    """The transformers state dict -> this repo's."""
    config_json: Callable[[C], str]
    """The config.json that makes `AutoModelForCausalLM.from_pretrained` build this model."""
    config_math: ConfigMath | Callable[[C], ConfigMath] | None = None
    """The config.json fields that change what the model computes and the [model] keys that set them, or a function
    of the model's config that gives them (None: checkpoint.init_from checks names and shapes only, and says so)."""
    read_config: Callable[[Path], dict | None] = read_config_json
    """A weights directory's config.json, complete (None if it has none), for the comparison."""
    errors: Callable[[C], list[str]] = lambda cfg: []
    """What keeps transformers' class from computing the model a config describes (export=hf is refused at launch)."""
    to_hf_local_experts: Callable[[StateDict, C, int], StateDict] | None = None
    """`to_hf` under expert parallelism, where each stacked expert weight holds this rank's experts only, the
    first of them expert `first` (the third argument; weights.py passes each as a DTensor over the ranks that
    share those experts, so a slice per expert is a view of this rank's shard); None: no stacked experts."""

    def math(self, cfg: C) -> ConfigMath | None:
        """The config.json math of the model `cfg` describes (None: it declares none)."""
        return self.config_math(cfg) if callable(self.config_math) else self.config_math


@dataclass(frozen=True)
class LoraLayout:
    """Where a block keeps its attention and feed-forward linear layers (finetune.lora_targets): a model's
    SPEC.lora (models/spec.py)."""

    attention: str
    """Name of the block's attention submodule: its linear layers are the `attention` targets."""
    mlp: str
    """Name of the block's feed-forward submodule: its linear layers are the `mlp` targets."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallelism (parallel.tensor_parallel) splits a model, Megatron-style.

    Module paths map to the names of layouts that parallelize.apply_tp turns into torch's
    parallel styles (so model files need no torch.distributed). With sequence parallelism the
    activations between the blocks are split along the sequence; without it they are whole on
    every rank of the group:

        embedding  an nn.Embedding split by vocabulary rows; its output leaves split by sequence
                   (reduce-scattered), or whole (all-reduced)
        colwise    an nn.Linear split by output features (its output keeps them split)
        rowwise    an nn.Linear split by input features; its output is reduce-scattered by
                   sequence, or all-reduced whole
        head       the output nn.Linear split by vocabulary; its logits are all-gathered whole
      with sequence parallelism only:
        sequence   a norm run on this rank's part of the sequence (its weight is replicated)
        gather     a module whose first input is all-gathered along the sequence before it runs
      without it only:
        replicate  a module (a norm) that every rank runs whole on whole activations

    Every parameter must be covered (parallelize.apply_tp checks): parameters left whole would
    sit on another device mesh than the split ones, which gradient clipping cannot mix.
    """

    root: dict[str, str]
    """Modules outside the blocks: path (from the model) -> layout."""
    block: dict[str, str]
    """Modules inside every block of `layers`: path (from the block) -> layout."""
    check: Callable[[ModelConfig, int, int], list[str]]
    """Every reason the model (its hyperparameters) cannot split `degree` ways at a sequence length
    (head counts and widths that do not divide)."""
    sequence_parallel: bool = True
    """Split the activations between the blocks by sequence (less activation memory, and norms run on
    1/degree of the positions); False keeps them whole, for models that need every position in each
    layer (transformers builds its attention mask from the length its layers see)."""


class BlockCache:
    """One block's cached keys and values, grown along the sequence by each `update`."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Positions held."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's keys and values (batch, heads, new positions, head size); return every position's."""
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        self.keys, self.values = keys, values
        return keys, values


class KVCache:
    """The keys and values of the positions a decoder has seen, one BlockCache per block, grown by every forward.

    It is what lets generation (generate.py) run a prompt once (prefill) and then one position a
    step, each new position attending to the cached ones instead of recomputing them. A model
    whose SPEC.kv_cache makes one takes it as `forward(tokens, cache=...)`: `tokens` are then the
    positions after the `length` cached ones, and block i's attention calls `blocks[i].update` with
    its new keys and values and attends to all that comes back. Any model whose blocks attend over
    keys and values meets it, a mixture-of-experts one too (its experts keep nothing between positions).
    """

    def __init__(self, blocks: int) -> None:
        self.blocks = [BlockCache() for _ in range(blocks)]

    @property
    def length(self) -> int:
        """Positions cached. Read it before a forward extends the cache: its first block grows first."""
        return self.blocks[0].length


def new_kv_cache(model: nn.Module) -> KVCache:
    """An empty KVCache for a model whose blocks are `model.layers` (a ModelSpec's `kv_cache`)."""
    return KVCache(len(model.layers))


@dataclass(frozen=True)
class ContextParallelPlan:
    """How context parallelism (parallel.context_parallel) splits a model's sequences: each rank of a group holds
    two chunks of every sequence (context_parallel.py), and attention, the one part of a block that mixes
    positions, sees them whole.

    A model with a plan takes `forward(inputs, *, positions=None)`: `positions` (seq,) are where this rank's
    tokens sit in their sequence, for position embeddings (the decoder's rotary table). Its attention computes
    through a submodule of its own, `forward(q, k, v, *, causal)` on (batch, heads, seq, head_dim) tensors
    without parameters (models/llama/model.py's AttentionCore), which context_parallel.py wraps so that it
    runs over the whole sequence for 1/degree of the heads (DeepSpeed-Ulysses).
    """

    core: str
    """Path (from a block of `layers`) of the attention core, e.g. "attention.core"."""
    check: Callable[[ModelConfig, int, int], list[str]]
    """Every reason the model cannot split its heads over `degree` ranks with tensor parallelism of
    `tensor_parallel` (the heads each rank holds must divide by the degree)."""


@dataclass(frozen=True)
class ModelSpec(Generic[C]):
    """Everything outside models/ needs to know about one model family."""

    config: type[C]
    """Its hyperparameters: the dataclass a config's `[model]` table is read into when it names this model."""
    build: Callable[[C], nn.Module]
    """A new, uninitialised model (called under torch.device("meta") to allocate nothing)."""
    shape: Callable[[C], ModelShape]
    """Its sizes and cost terms, for the planner and the MFU figure."""
    inputs: Literal["tokens", "images"] = "tokens"
    """What a batch holds: token ids (targets: the next tokens; the config has `vocab_size`) or images
    (targets: class ids; the config has `image_size`, `channels` and `num_classes`), for data/."""
    hf: HFLayout | None = None
    """The Hugging Face weight layout, for models transformers can load (None: export=hf refused)."""
    lora: LoraLayout | None = None
    """Where LoRA adapters go in a block (models/lora.py); None: finetune.method=lora is refused."""
    tp_plan: TensorParallelPlan | Callable[[C], TensorParallelPlan] | None = None
    """How tensor parallelism splits the model, or a function that makes the plan from the model's config
    (None: parallel.tensor_parallel > 1 is refused, saying `tp_refusal`); read it with `tensor_parallel_plan`."""
    tp_refusal: str = "its module declares no tensor-parallel plan (SPEC.tp_plan, models/spec.py)"
    """Why the model has no tensor-parallel plan, for the refusal."""
    cp_plan: ContextParallelPlan | None = None
    """How context parallelism splits the model's sequences (None: parallel.context_parallel > 1 is refused,
    saying `cp_refusal`)."""
    cp_refusal: str = "its module declares no context-parallel plan (SPEC.cp_plan, models/spec.py)"
    """Why the model has no context-parallel plan, for the refusal."""
    lora_refusal: str = ""
    """Why the model has no LoRA layout (SPEC.lora None), for the refusal."""
    kv_cache: Callable[[nn.Module], object] | None = None
    """A new, empty key/value cache for the built model (a KVCache, or the model's own kind), which its forward
    then takes as `cache=` (generate.py); None: generation recomputes the whole sequence for every token."""

    def tensor_parallel_plan(self, cfg: C) -> TensorParallelPlan | None:
        """The tensor-parallel plan of the model `cfg` describes (None: the model has none)."""
        return self.tp_plan(cfg) if callable(self.tp_plan) else self.tp_plan
