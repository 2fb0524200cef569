"""Full model weights: the initial ones, pretrained ones read in, and exported ones.

Pretrained weights (`checkpoint.init_from`: a directory of safetensors files, this repo's names
or a Hugging Face model's) are checked before the process group starts: what their config.json
says the model computes (the fields the model's adapter declares, models/config_math.py), then names
and shapes. They and exports are read and written through DCP's Hugging Face storage:
each rank reads or writes only the slices it holds, so no rank ever holds the whole model. An
export is `model.safetensors`, or `model-0000x-of-0000y.safetensors` with an index once the model
passes checkpoint.export_file_gb (5 GB, as transformers' save_pretrained). `safetensors` keeps
this repo's parameter names; `hf` writes a Hugging Face directory (with config.json) that
`transformers.AutoModelForCausalLM.from_pretrained` loads, for models whose spec has a Hugging
Face layout (models/spec.py): its state-dict adapter maps names and tensor layouts both ways, for
import and export alike. Nothing here knows a model by name: names, layouts, tied weights and
config.json come from the model and its spec, which the trainer resolves once and passes in
(`load` and `save`, for tools and tests, resolve it from the config). A LoRA model
(finetune.method=lora) starts from pretrained or seeded base weights plus seeded adapters, and
exports plain weights with the adapters merged in, which load anywhere the base model does, and
the adapters alone as a PEFT adapter directory beside them (export/adapter: save_adapter), for
each adapted layer whose Hugging Face layout only renames it. Converting a distributed checkpoint
offline: convert.py."""

from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from .checkpoint import checkpoint_to_resume
from .config import JOB_WIDE, CheckpointConfig, FinetuneConfig, UsageError
from .expert_parallel import split_experts
from .model_record import other_architecture
from .models import ModelConfig, ModelSpec, model_spec
from .models.lora import ADAPTERS, LoraSettings, apply_lora, initial_adapters, merge_adapters, peft_adapter
from .models.spec import StateDict
from .strategy import Strategy
from .train_state import plain_tensors

logger = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
ADAPTER_DIR = "adapter"
"""An export's subdirectory that holds a LoRA run's adapters alone, as PEFT saves them (save_adapter)."""


def shared_keys(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that alias an earlier one (a tied output head -> its embedding)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


class Layout(NamedTuple):
    """How files of one format store this model: the state-dict adapter both ways (models/spec.py's
    HFLayout; none for this repo's own names), what goes through it, and the names it makes."""

    to_files: Callable[[StateDict], StateDict]
    """This repo's state dict -> the files' (names and layouts)."""
    from_files: Callable[[StateDict], StateDict]
    """The files' state dict -> this repo's."""
    ours: tuple[str, ...]
    """The base model's state-dict names that are stored: tied aliases are stored once, under the first
    name (safetensors refuses shared tensors), and LoRA's adapters never (an export merges them in)."""
    aliases: dict[str, str]
    """Parameter names that alias an earlier one (shared_keys)."""
    names: dict[str, list[int]]
    """Every tensor name the files hold -> its shape."""
    local_experts: Callable[[StateDict, int], StateDict] | None = None
    """to_files of this rank's experts under expert parallelism (HFLayout.to_hf_local_experts; None: no adapter
    to split them, the files hold the weights as they are)."""

    def stored(self, state: StateDict) -> StateDict:
        """`state` (this repo's names) as the files hold it."""
        whole, experts = self.split(state)
        return self.to_files(whole) | experts

    def split(self, state: StateDict) -> tuple[StateDict, StateDict]:
        """The stored weights for to_files, and this rank's experts as the files hold them (expert_parallel.py)."""
        return split_experts({k: state[k] for k in self.ours}, self.local_experts)


def file_layout(spec: ModelSpec, cfg: ModelConfig, fmt: str, model: torch.nn.Module | None = None) -> Layout:
    """How `fmt` files (safetensors: this repo's names; hf: the spec's Hugging Face layout) store the
    model (`model`: the base model, on the meta device, if the caller has built it)."""
    if fmt == "hf" and spec.hf is None:
        raise ValueError(f"model.name={cfg.name} has no Hugging Face layout: use safetensors")
    to_files, from_files = dict, dict
    if fmt == "hf":  # the adapter, for this model's hyperparameters
        to_files = functools.partial(_adapt, spec.hf.to_hf, cfg)
        from_files = functools.partial(_adapt, spec.hf.from_hf, cfg)
    model = model or build_model_on_meta(spec, cfg)
    aliases = shared_keys(model)
    state = {k: v for k, v in model.state_dict().items() if k not in aliases}
    # On the meta device: the names and shapes the adapter makes, with nothing allocated.
    names = {k: list(v.shape) for k, v in to_files(state).items()}
    local = spec.hf.to_hf_local_experts if fmt == "hf" else None
    experts = local and (lambda state, first: local(state, cfg, first))
    return Layout(to_files, from_files, tuple(state), aliases, names, experts)


def _adapt(adapter: Callable[[StateDict, ModelConfig], StateDict], cfg: ModelConfig, state: StateDict) -> StateDict:
    """`adapter` (an HFLayout's to_hf or from_hf) of `state`, for the model `cfg` describes."""
    return adapter(state, cfg)


def stored_shapes(directory: Path) -> dict[str, list[int]]:
    """Shape of every tensor in a directory of safetensors files, read from the file headers only."""
    shapes = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    return shapes


def weights_dir(path: Path) -> Path:
    """The directory DCP's Hugging Face reader reads: `path`, or the directory of a lone .safetensors file."""
    if path.is_file():
        others = sorted(p.name for p in path.parent.glob("*.safetensors") if p != path)
        if others:
            raise ValueError(f"{path} shares its directory with {others[:3]}: name the directory instead")
        return path.parent
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise ValueError(f"{path}: no .safetensors files there")
    return path


def match_layout(spec: ModelSpec, cfg: ModelConfig, directory: Path) -> Layout:
    """How the files in `directory` store this model; ValueError naming the misfit if they do not."""
    model = build_model_on_meta(spec, cfg)
    stored = stored_shapes(directory)
    misfits = []
    for fmt in ("safetensors", "hf") if spec.hf else ("safetensors",):
        layout = file_layout(spec, cfg, fmt, model)  # one meta build for both
        # A tied head may be stored besides its embedding; it is then ignored.
        missing = set(layout.names) - set(stored)
        extra = set(stored) - set(layout.names) - set(layout.to_files(model.state_dict()))
        if not missing and not extra:
            break
        misfits.append((len(missing) + len(extra), sorted(missing)[:5], sorted(extra)[:5]))
    else:
        _, missing, extra = min(misfits)
        raise ValueError(f"{directory} does not fit model {cfg.preset}: missing {missing}, unexpected {extra}")
    shapes = [f"{name} is {stored[name]} there, {shape} here" for name, shape in layout.names.items()
              if stored[name] != shape]  # fmt: skip
    if shapes:
        raise ValueError(
            f"{directory} does not fit model {cfg.preset} (check the model.* sizes): {'; '.join(shapes[:3])}"
        )
    return layout


def match_config(spec: ModelSpec, cfg: ModelConfig, directory: Path) -> None:
    """ValueError naming every field of the directory's config.json that computes otherwise than this model,
    among those its adapter declares (HFLayout.config_math, models/config_math.py); nothing to compare without a
    config.json (this repo's safetensors export), or for a model that declares no fields (it is said once)."""
    hf = spec.hf
    theirs = hf.read_config(directory) if hf else None
    if theirs is None:
        return
    if unmatched := [error.partition(" ")[0] for error in hf.errors(cfg)]:  # options transformers' class lacks
        raise ValueError(
            f"it holds a transformers model (config.json) that has no counterpart for {', '.join(unmatched)}, nor "
            "weights for them: set those to what transformers computes, or start from weights this repo exported "
            "as safetensors"
        )
    math, ours = hf.math(cfg), json.loads(hf.config_json(cfg))
    if other := other_architecture(theirs, ours, model=cfg.name, also=math.model_types if math else ()):
        raise ValueError(other)
    if math is None:
        logger.warning("checkpoint.init_from=%s: model.name=%s declares no config.json fields (HFLayout.config_math), "
                       "so only names and shapes are checked", directory, cfg.name, extra=JOB_WIDE)  # fmt: skip
        return
    refusal = math.refusal(ours, theirs, str(directory))
    if refusal:
        raise ValueError(f"its config.json describes a model that computes otherwise than [model]: {refusal}")


def check_init_from(
    *, checkpoint: CheckpointConfig, finetune: FinetuneConfig, model: ModelConfig, spec: ModelSpec, run_dir: Path
) -> None:
    """Refuse, before the process group starts, checkpoint.init_from weights that do not fit the model (what
    config.json says it computes, then names and shapes), and LoRA with nothing pretrained to start from."""
    c = checkpoint
    if not c.init_from:
        if finetune.method == "lora" and checkpoint_to_resume(checkpoint=checkpoint, run_dir=run_dir) is None:
            raise UsageError(
                "finetune.method=lora needs checkpoint.init_from: LoRA freezes pretrained weights and trains "
                "adapters beside them, and from a random init it would train adapters on noise. Set "
                "checkpoint.init_from to a directory of safetensors files (a Hugging Face model, or an export "
                "such as runs/debug/export, which `bash scripts/run_local.sh` writes), or finetune.method=full"
            )
        return
    try:
        directory = weights_dir(Path(c.init_from))
        match_config(spec, model, directory)
        match_layout(spec, model, directory)
    except ValueError as error:
        raise UsageError(f"checkpoint.init_from={c.init_from}: {error}") from None


def load_pretrained(model: torch.nn.Module, *, init_from: str, model_cfg: ModelConfig, spec: ModelSpec) -> None:
    """Read checkpoint.init_from into the (sharded) model: every rank reads only the slices it holds."""
    directory = weights_dir(Path(init_from))
    layout = match_layout(spec, model_cfg, directory)
    whole, experts = layout.split(plain_tensors(get_model_state_dict(model)))
    whole = layout.to_files(whole)
    dcp.load(whole | experts, storage_reader=HuggingFaceStorageReader(str(directory)))
    # DCP filled the files' tensors: views of the shards (renamed or transposed) in place, or new ones
    # (fused). Setting the model from them, mapped back, covers both, and re-ties what it left out (tied heads);
    # this rank's experts under expert parallelism were views, filled in place.
    set_model_state_dict(model, layout.from_files(whole), options=StateDictOptions(strict=False))
    logger.info("loaded %s weights from %s", len(layout.names), directory)


def apply_initial_weights(
    model: torch.nn.Module, *, spec: ModelSpec, model_cfg: ModelConfig, finetune: FinetuneConfig, init_from: str,
    seed: int, strategy: Strategy,
) -> None:  # fmt: skip
    """The starting weights on every rank: checkpoint.init_from's, or rank 0's seeded init.

    With LoRA the adapters start from rank 0's seeded draws too (and B = 0, so the model computes
    what its base weights do): with init_from they come after the pretrained weights, as a
    second, small broadcast that leaves the pretrained weights as they are.
    """
    if init_from:
        load_pretrained(model, init_from=init_from, model_cfg=model_cfg, spec=spec)
        if finetune.method == "lora":
            meta = build_model_on_meta(spec, model_cfg, finetune)  # the adapters' state-dict names, unwrapped
            strategy.apply_weights_from_rank0(model, lambda: initial_adapters(meta, seed), strict=False)
        return
    initial = functools.partial(initial_state, spec=spec, model_cfg=model_cfg, finetune=finetune, seed=seed)
    strategy.apply_weights_from_rank0(model, initial)


def file_index(state: dict[str, torch.Tensor], max_bytes: float) -> dict[str, int]:
    """Export file (1, 2, ...) of each tensor: in order, a new file whenever one would pass max_bytes."""
    index, file, size = {}, 1, 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()  # of the whole tensor, not this rank's shard
        if size and size + nbytes > max_bytes:
            file, size = file + 1, 0
        index[key], size = file, size + nbytes
    return index


def export_weights(
    model: torch.nn.Module, *, spec: ModelSpec, model_cfg: ModelConfig, checkpoint: CheckpointConfig,
    finetune: FinetuneConfig, out: Path, is_main: bool,
) -> None:  # fmt: skip
    """Write the full weights to `out` (a collective: every rank calls this, and writes only its shards).

    DCP's Hugging Face writer has each rank write its shards under out/sharded, then rank 0 joins
    them tensor by tensor into the final files; a model in one file is named model.safetensors.
    """
    fmt, f = checkpoint.export, finetune
    layout = file_layout(spec, model_cfg, fmt)
    state = plain_tensors(get_model_state_dict(model))
    merged = state
    if f.method == "lora":  # plain weights under the base names: W + (alpha / rank) B A, merged shard by shard
        merged = merge_adapters(state, f.lora_alpha / f.lora_rank)
    # DCP's writer takes contiguous shards only: a view the adapter made (a transpose) is copied, shard by shard.
    stored = {k: v.contiguous() for k, v in layout.stored(merged).items()}
    if is_main and out.exists():
        shutil.rmtree(out)  # a previous export of this run dir (an extended run): replaced whole
    dist.barrier()
    # Under expert parallelism a rank holds some experts' tensors: every rank numbers the files by the whole model.
    dtype = next(iter(stored.values())).dtype
    whole = {k: torch.empty(shape, dtype=dtype, device="meta") for k, shape in layout.names.items()}
    writer = HuggingFaceStorageWriter(
        str(out),
        fqn_to_index_mapping=file_index(whole if layout.local_experts else stored, checkpoint.export_file_gb * 1e9),
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(stored, storage_writer=writer)
    if is_main:
        shutil.rmtree(out / "sharded")
        files = sorted(out.glob("*.safetensors"))
        if len(files) == 1:  # one file: the plain name, no index (as save_pretrained does)
            files[0].rename(out / "model.safetensors")
            (out / INDEX).unlink()
        if fmt == "hf":
            (out / "config.json").write_text(spec.hf.config_json(model_cfg))
        logger.info("exported %s weights to %s (%d file(s))", fmt, out, len(files))
    if f.method == "lora" and spec.hf:  # PEFT adapts transformers' modules, by their names
        export_adapter(state, spec=spec, model_cfg=model_cfg, finetune=f, init_from=checkpoint.init_from,
                       out=out / ADAPTER_DIR, is_main=is_main)  # fmt: skip


def peft_modules(spec: ModelSpec, cfg: ModelConfig) -> dict[str, str]:
    """This repo's name of each layer whose Hugging Face layout only renames it -> its transformers module's name,
    for PEFT, which adapts transformers' modules by name. A layer whose weights the adapter fuses, splits or
    transposes is left out: no transformers module computes what it does once adapted (empty without a layout)."""
    if spec.hf is None:
        return {}
    renamed: dict[str, str | None] = {}
    for key, tensor in build_model_on_meta(spec, cfg).state_dict().items():
        layer = key.rpartition(".")[0]
        try:
            ((theirs, same),) = spec.hf.to_hf({key: tensor}, cfg).items()
        except (KeyError, ValueError):  # the adapter needs other weights beside this one: it fuses them
            same, theirs = None, ""
        # A layer is renamed only if every parameter of it is (a bias renamed beside a transposed weight is not).
        kept = same is tensor and renamed.get(layer, "") is not None
        renamed[layer] = theirs.rpartition(".")[0] if kept else None
    return {ours: theirs for ours, theirs in renamed.items() if theirs is not None}


def export_adapter(
    state: dict[str, torch.Tensor], *, spec: ModelSpec, model_cfg: ModelConfig, finetune: FinetuneConfig,
    init_from: str, out: Path, is_main: bool,
) -> None:  # fmt: skip
    """The adapters of a LoRA model's state dict, gathered whole (a collective: every rank calls this), written
    by rank 0 as a PEFT adapter directory (save_adapter). They are small: r (in + out) values per layer."""
    modules = peft_modules(spec, model_cfg)
    adapters = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()
                if k.rpartition(".")[2] in ADAPTERS}  # fmt: skip
    if is_main and save_adapter(adapters, finetune=finetune, init_from=init_from, out=out, modules=modules):
        logger.info("exported the LoRA adapters alone to %s (peft.PeftModel.from_pretrained loads them)", out)


def save_adapter(
    state: dict[str, torch.Tensor], *, finetune: FinetuneConfig, init_from: str, out: Path, modules: dict[str, str]
) -> Path | None:
    """Write the adapters of a full LoRA state dict (this repo's names) into `out`, in one process, as PEFT does:
    adapter_config.json and adapter_model.safetensors, under the transformers module names of the base model
    (checkpoint.init_from; `modules`: peft_modules), which `peft.PeftModel.from_pretrained(base_model, out)` adapts.

    Adapted layers that `modules` leaves out (their layout is transformed) are named in a warning and left out:
    the merged export holds them. None, and nothing written, when no adapted layer is left."""
    layers = sorted({k.rpartition(".")[0] for k in state if k.rpartition(".")[2] in ADAPTERS})
    left_out = [layer for layer in layers if layer not in modules]
    if left_out:
        logger.warning("the PEFT adapter directory leaves out %d of %d adapted layers (%s%s): the Hugging Face layout "
                       "transforms their weights, so no transformers module computes what they do; the merged "
                       "export holds them", len(left_out), len(layers), ", ".join(left_out[:3]),
                       ", ..." if len(left_out) > 3 else "")  # fmt: skip
    kept = {k: v for k, v in state.items() if k.rpartition(".")[0] in modules}
    if not any(k.rpartition(".")[2] in ADAPTERS for k in kept):
        return None
    tensors, config = peft_adapter(kept, finetune, modules.__getitem__, init_from or None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, out / "adapter_model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    return out


def save(state: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, fmt: str) -> Path:
    """Write a full state dict (this repo's names) as `fmt` (safetensors or hf) into `out`, in one process."""
    spec = model_spec(cfg.name)
    stored = file_layout(spec, cfg, fmt).stored(state)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in stored.items()}
    if fmt == "hf":
        (out / "config.json").write_text(spec.hf.config_json(cfg))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt", "layout": fmt})
    return out / "model.safetensors"


def load(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A full state dict (this repo's names) from safetensors files, in one process (tests, tools)."""
    spec, directory = model_spec(cfg.name), weights_dir(Path(path))
    layout = match_layout(spec, cfg, directory)
    files = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            files.update({k: f.get_tensor(k) for k in f.keys() if k in layout.names})
    tensors = layout.from_files(files)
    for alias, source in layout.aliases.items():
        tensors[alias] = tensors[source]
    return tensors


def build_model_on_meta(spec: ModelSpec, cfg: ModelConfig, finetune: LoraSettings | None = None) -> torch.nn.Module:
    """The model (with LoRA's adapters when `finetune` has them) on the meta device: names and shapes only."""
    with torch.device("meta"):
        model = spec.build(cfg)
    if finetune is not None:
        apply_lora(model, finetune=finetune, layout=spec.lora)
    return model


def initial_state(
    *, spec: ModelSpec, model_cfg: ModelConfig, finetune: FinetuneConfig, seed: int
) -> dict[str, torch.Tensor]:
    """Rank 0's full initial weights: a seeded random init, the same at any world size (LoRA adapters included)."""
    with torch.device("cpu"):
        reference = spec.build(model_cfg)
    reference.init_weights(torch.Generator().manual_seed(seed))
    state = reference.state_dict()
    if finetune.method == "lora":
        state |= initial_adapters(build_model_on_meta(spec, model_cfg, finetune), seed)
    return state
