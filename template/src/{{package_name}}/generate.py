"""`python -m <package>.generate`: what a trained model says, in one process (no process group, no launcher).

    python -m <package>.generate --config configs/debug.toml --prompt "0 1 2 3"
    python -m <package>.generate --config CONFIG --weights runs/x/export --prompt-file prompts.txt
    python -m <package>.generate --config CONFIG --chat chats.jsonl --temperature 0.7 --top-p 0.9 --seed 1

The weights (`--weights`): a DCP checkpoint (`<run_dir>/checkpoints/step_*`), saved at any world
size and read whole into this process as convert.py reads it (a LoRA run's adapters merged in), or
a directory of safetensors files (an export, or a Hugging Face model, checked as checkpoint.init_from
is). Without `--weights`: checkpoint.resume's checkpoint, or the run's newest complete one, else
checkpoint.init_from. Text goes through `data.tokenizer`, the tokenizer `data prepare` used; with
synthetic data or no tokenizer, prompts and outputs are token ids. `--chat` renders chats with the
tokenizer's chat template (for models fine-tuned on chats). Greedy unless `--temperature` is above 0;
`--top-k` and `--top-p` narrow the sampling, `--seed` repeats it. Models with a key/value cache
(SPEC.kv_cache: the built-in decoders', llama and qwen3_moe; transformers' own for hf_causal_lm) run
the prompt once, then one token a step; the others recompute the sequence for every token. Bad input
is refused in one line naming the fix, with exit code 2 (config.EXIT_USAGE), as the trainer and `data
prepare` refuse it.
It is a tool of its own, not a step of training: a validation-time sample (eval.sample_prompts) would
run forwards of new lengths through compiled, tensor-parallel blocks built for train.seq_len.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import checkpoint_steps, verify
from .config import EXIT_USAGE, CheckpointConfig, DataConfig, FinetuneConfig, UsageError, load_config
from .config.load import TRAIN
from .convert import load_checkpoint
from .data import source_spec
from .distributed import resolve_device
from .model_record import checkpoint_refusal
from .models import ModelConfig, ModelSpec, model_spec
from .parallelize import DTYPES
from .weights import load, match_config, weights_dir


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits: greedy (temperature 0), or sampled."""

    temperature: float = 0.0
    """0: the most likely token (greedy); above 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to top_p (1: all)."""
    seed: int = 0
    """Seed of the draws: the same seed, weights and prompt give the same text."""

    def errors(self) -> list[str]:
        return [
            message
            for ok, message in (
                (self.temperature >= 0, f"--temperature {self.temperature} must be 0 (greedy) or more"),
                (self.top_k >= 0, f"--top-k {self.top_k} must be 0 (every token) or more"),
                (0 < self.top_p <= 1, f"--top-p {self.top_p} must be in (0, 1]"),
            )
            if not ok
        ]


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of `logits` (batch, vocabulary): its argmax, or a draw as `sampling` says.

    top-k keeps the k largest logits; top-p keeps the most likely tokens until their probability reaches
    top_p (the one that crosses it included, so at least one), as transformers' TopPLogitsWarper does.
    """
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # the mass of the more likely tokens
        logits = logits.scatter(-1, order, ordered.masked_fill(before >= sampling.top_p, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@dataclass
class Generated:
    tokens: list[int]
    """The new tokens, after the prompt."""
    prompt_seconds: float
    """Time of the forward pass over the prompt (prefill)."""
    seconds: float
    """Time of the whole generation, prompt included."""

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)


@torch.no_grad()
def generate(
    model: nn.Module, prompt: list[int], *, max_new_tokens: int, sampling: Sampling = Sampling(),
    cache: object | None = None, stop: int | None = None, device: torch.device | str = "cpu",
) -> Generated:  # fmt: skip
    """Up to `max_new_tokens` tokens after `prompt`, one sequence, stopping after `stop` (an end-of-text id).

    With a `cache` (the model's SPEC.kv_cache, empty) the prompt runs once and every later step runs only
    its new token, which attends to the cached keys and values; without, each step runs the whole
    sequence. Both compute the same logits up to rounding, so greedy decoding picks the same tokens.
    """
    model.eval()
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    sequence = torch.tensor([prompt], device=device)
    started = time.perf_counter()
    logits = model(sequence) if cache is None else model(sequence, cache=cache)
    prompt_seconds = time.perf_counter() - started
    new: list[int] = []
    while True:
        token = pick(logits[:, -1], sampling, generator)
        new.append(int(token))
        if len(new) == max_new_tokens or new[-1] == stop:
            break
        sequence = torch.cat([sequence, token[:, None]], dim=1)
        logits = model(sequence) if cache is None else model(token[:, None], cache=cache)
    return Generated(new, prompt_seconds, time.perf_counter() - started)


def build_for_generation(spec: ModelSpec, cfg: ModelConfig, state: dict[str, torch.Tensor], device) -> nn.Module:
    """The model of `cfg` holding the full weights `state` (this repo's names), on `device`, in eval mode: built on
    the meta device and materialised once, as the trainer builds it, with its non-persistent buffers recomputed."""
    with torch.device("meta"):
        model = spec.build(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.load_state_dict(state)
    model.init_buffers()
    return model.eval()


def find_weights(weights: Path | None, *, checkpoint: CheckpointConfig, run_dir: Path) -> Path:
    """The weights to generate from: `weights`, else checkpoint.resume's checkpoint when it names one, else the run's
    newest complete checkpoint, else checkpoint.init_from."""
    if weights is not None:
        if not weights.exists():
            raise UsageError(f"--weights {weights}: no such file or directory")
        return weights
    if checkpoint.resume not in ("auto", "never"):  # the checkpoint this run's config names
        return find_weights(Path(checkpoint.resume), checkpoint=checkpoint, run_dir=run_dir)
    steps = checkpoint_steps(run_dir / "checkpoints")
    if steps:
        return steps[max(steps)]
    if checkpoint.init_from:
        return Path(checkpoint.init_from)
    raise UsageError(
        f"nothing to generate from: {run_dir}/checkpoints holds no complete checkpoint and checkpoint.init_from is "
        "empty; train first (bash scripts/run_local.sh), point --run_dir at a run that saved one, or pass --weights "
        "with a checkpoint (step_*) or an export directory"
    )


def read_weights(
    path: Path, *, spec: ModelSpec, model: ModelConfig, finetune: FinetuneConfig
) -> dict[str, torch.Tensor]:
    """The full weights at `path` under this repo's names: a DCP checkpoint read whole into this process (LoRA's
    adapters merged), or safetensors files whose config.json computes what [model] does (init_from's checks)."""
    if (path / ".metadata").is_file():
        problem = verify(path)
        if problem:
            raise UsageError(f"--weights {path}: not a complete checkpoint ({problem}); name a step_* that finished")
        otherwise = f"name a checkpoint of this config's {model.name} with --weights"
        if problem := checkpoint_refusal(path, model=model, spec=spec, where=f"--weights {path}", otherwise=otherwise):
            raise UsageError(problem)
        try:
            return load_checkpoint(path, model, finetune)
        except ValueError as error:  # a checkpoint of the other finetune.method
            raise UsageError(f"--weights {path}: {error}") from None
    try:
        directory = weights_dir(path)
        match_config(spec, model, directory)
        return load(directory, model)
    except ValueError as error:
        raise UsageError(f"--weights {path}: {error}") from None


class Tokens:
    """Prompts to token ids and ids to text: through data.tokenizer, or ids written as numbers when there is none."""

    def __init__(self, data: DataConfig, vocab_size: int):
        self.vocab_size, self.tok = vocab_size, None
        if data.tokenizer and source_spec(data.source).reads:  # generated data is no tokenizer's ids
            self.tok = load_tokenizer(Path(data.tokenizer))
            if len(self.tok) > vocab_size:
                raise UsageError(
                    f"data.tokenizer={data.tokenizer} has {len(self.tok)} tokens, more than model.vocab_size="
                    f"{vocab_size}: it is not the tokenizer this model was trained with; set data.tokenizer to the "
                    "--tokenizer the data was prepared with (data prepare)"
                )

    @property
    def what(self) -> str:
        """What a prompt is here, for a refusal."""
        return "text, read by data.tokenizer" if self.tok else "token ids separated by spaces, e.g. '1 5 7'"

    @property
    def stop(self) -> int | None:
        """The end-of-text id generation stops after (None for token ids: they run to --max-new-tokens)."""
        return None if self.tok is None else self.tok.eos_token_id

    def encode(self, prompt: str, where: str) -> list[int]:
        if self.tok is not None:
            return self.tok(prompt)["input_ids"]
        try:
            ids = [int(word) for word in prompt.replace(",", " ").split()]
        except ValueError:
            raise UsageError(
                f"{where} {prompt[:40]!r}: without a tokenizer (data.tokenizer unset, or synthetic data) a prompt is "
                "token ids separated by spaces, e.g. '1 5 7'; set data.tokenizer to the tokenizer the data was "
                "prepared with for text"
            ) from None
        if not ids:  # only separators
            raise UsageError(f"{where} {prompt[:40]!r} holds no token id: give {self.what}")
        outside = [i for i in ids if not 0 <= i < self.vocab_size]
        if outside:
            raise UsageError(f"{where}: token ids {outside[:5]} are outside [0, model.vocab_size={self.vocab_size})")
        return ids

    def chat(self, messages: list[dict], where: str) -> list[int]:
        """A chat rendered with the tokenizer's chat template, ready for the assistant's reply."""
        if self.tok is None or not getattr(self.tok, "chat_template", None):
            raise UsageError(f"{where}: a chat needs data.tokenizer with a chat template (chat_template in "
                             "tokenizer_config.json), the one the chats were prepared with")  # fmt: skip
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids)) if self.tok is None else self.tok.decode(ids)


def load_tokenizer(path: Path):
    """The tokenizer in a local directory (nothing is downloaded)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError('data.tokenizer needs transformers: pip install -e ".[data]"') from None
    if not path.is_dir():
        raise UsageError(f"data.tokenizer={path}: no such directory (a local tokenizer, as save_pretrained writes it)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def read_prompts(args: argparse.Namespace, tokens: Tokens) -> list[tuple[str, list[int]]]:
    """(what to print before the output, token ids) for each prompt of the command line."""
    if args.chat is not None:
        if not args.chat.is_file():
            raise UsageError(f"--chat {args.chat}: no such file")
        prompts = []
        for number, line in enumerate(args.chat.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{args.chat}:{number}"
            try:
                messages = json.loads(line)["messages"] if line.strip() else None
            except (ValueError, KeyError, TypeError):
                raise UsageError(where + ': not a chat: one JSON object a line, {"messages": [...]}') from None
            if messages:
                prompts.append(("", tokens.chat(messages, where)))
        if not prompts:
            raise UsageError(f"--chat {args.chat}: no chat in it; write one a line, " + '{"messages": [...]}')
        return prompts
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise UsageError(f"--prompt-file {args.prompt_file}: no such file")
        lines = [line for line in args.prompt_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not lines:
            raise UsageError(f"--prompt-file {args.prompt_file}: no prompt in it, only blank lines; write one a line")
        return [(line, tokens.encode(line, f"--prompt-file line {n}")) for n, line in enumerate(lines, 1)]
    if not args.prompt.strip():
        raise UsageError(f"--prompt {args.prompt!r} is blank: give the text to continue ({tokens.what})")
    return [(args.prompt, tokens.encode(args.prompt, "--prompt"))]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog=f"{__package__}.generate", description=__doc__.splitlines()[0],
        epilog=f"The config's flags follow: --config FILE, and every flag `{TRAIN} --help` lists.",
    )  # fmt: skip
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--prompt", help="text, or token ids separated by spaces without a tokenizer")
    given.add_argument("--prompt-file", type=Path, help="one prompt a line")
    given.add_argument("--chat", type=Path, help='chats, one a line: {"messages": [{"role": ..., "content": ...}]}')
    parser.add_argument("--weights", type=Path, help="a checkpoint (step_*) or a directory of safetensors files")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: every token")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: every token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    parser.add_argument("--json", action="store_true", help="one JSON line per prompt instead of text")
    args, rest = parser.parse_known_args(argv)
    if args.prompt is None and args.prompt_file is None and args.chat is None:
        raise UsageError("give --prompt TEXT, --prompt-file FILE or --chat FILE")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    return args, rest


def run(argv: list[str] | None) -> None:
    """Load the config and the weights, read the prompts, and print what the model generates for each."""
    args, rest = parse(argv)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if sampling.errors():
        raise UsageError("; ".join(sampling.errors()))
    cfg = load_config(rest)
    spec, m = model_spec(cfg.model.name), cfg.model
    if spec.inputs != "tokens":
        raise UsageError(f"model.name={m.name} takes {spec.inputs}, not tokens: it has no text to generate")
    tokens = Tokens(cfg.data, m.vocab_size)
    prompts = read_prompts(args, tokens)  # before the weights load: bad prompts cost nothing
    context, new = getattr(m, "max_seq_len", None), args.max_new_tokens
    for _, ids in prompts:
        if context is not None and len(ids) + new > context:
            raise UsageError(
                f"a prompt of {len(ids)} tokens and --max-new-tokens {new} make {len(ids) + new}, beyond the "
                f"model's context (model.max_seq_len={context}): shorten the prompt or lower --max-new-tokens"
            )
    path = find_weights(args.weights, checkpoint=cfg.checkpoint, run_dir=Path(cfg.run_dir))
    state = read_weights(path, spec=spec, model=m, finetune=cfg.finetune)
    device = resolve_device(cfg.device, 0)
    model = build_for_generation(spec, m, state, device)
    dtype = DTYPES[cfg.parallel.mixed_precision] if device.type != "cpu" else torch.float32
    lower = torch.autocast(device.type, dtype) if dtype != torch.float32 else contextlib.nullcontext()
    cached = spec.kv_cache is not None and not args.no_cache
    print(f"generating from {path} ({'key/value cache' if cached else 'no cache'}, {device})", file=sys.stderr)
    for number, (label, ids) in enumerate(prompts, 1):
        with lower:
            out = generate(model, ids, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tokens.stop,
                           cache=spec.kv_cache(model) if cached else None, device=device)  # fmt: skip
        text = tokens.decode(out.tokens)
        if args.json:
            print(json.dumps({"prompt": number, "prompt_tokens": ids, "tokens": out.tokens, "text": text,
                              "seconds": out.seconds, "tokens_per_s": out.tokens_per_s}), flush=True)  # fmt: skip
        else:
            print(f"{label}{' ' if label and tokens.tok is None else ''}{text}")
            print(f"[{len(out.tokens)} tokens in {out.seconds:.2f} s: {out.tokens_per_s:.1f} tokens/s; prompt of "
                  f"{len(ids)} tokens in {out.prompt_seconds:.3f} s]", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """The command line: bad input is one line on stderr and exit code 2 (config.EXIT_USAGE), never a traceback."""
    try:
        run(argv)
    except UsageError as error:
        print(f"{__package__}.generate: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


if __name__ == "__main__":
    main()
