"""Chats into a token file and its mask of scored targets: what `python -m <package>.data prepare --jsonl` runs.

Each chat is rendered with the tokenizer's own chat template; the chats are packed in file order
into a token file for `data.source = "sft"`, and a held-out share of them into val.bin beside it
(for `eval.path`), each with its mask (sources/sft.py's mask_path). The mask scores the assistant's turns
only (encode_chat says which tokens those are), which MaskedTokens turns into IGNORE_INDEX targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import TrainConfig, UsageError
from .corpus import Outputs, load_tokenizer, token_dtype
from .held_out import check_held_out_window, held_out_count
from .sources.sft import mask_path

SEQ_LEN = TrainConfig.seq_len
"""train.seq_len's default (the debug config's): the window `data prepare --jsonl` holds out one of by default."""
ROW_FORMS = '{"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "response": ...}'
"""The rows of a JSONL file of chats that `data prepare --jsonl` reads."""


def read_chats(jsonl: Path) -> list[tuple[str, list[dict]]]:
    """(file:line, messages) for every row of a JSONL file of chats; a bad row is refused by its file:line.

    A row is {"messages": [{"role": ..., "content": ...}, ...]} (any roles the chat template knows,
    at least one "assistant"), or {"prompt": ..., "response": ...}: a user turn and the reply.
    """
    if not jsonl.is_file():
        raise UsageError(f"--jsonl {jsonl}: no such file")
    chats = []
    with jsonl.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            where = f"{jsonl}:{number}"
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                raise UsageError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
            chats.append((where, _messages(row, where)))
    if not chats:
        raise UsageError(f"--jsonl {jsonl}: no rows")
    return chats


def _messages(row, where: str) -> list[dict]:
    """A row's chat as a list of messages; UsageError naming the row when it is neither form."""
    if isinstance(row, dict) and "messages" not in row and {"prompt", "response"} <= row.keys():
        if isinstance(row["prompt"], str) and isinstance(row["response"], str):
            return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        got = f"keys {sorted(row)}" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
        raise UsageError(f"{where}: expected {ROW_FORMS} with strings for values, got {got}")
    for i, message in enumerate(messages, 1):
        if not (isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))):
            got = json.dumps(message)[:80]
            raise UsageError(f'{where}: message {i} needs a string "role" and "content", got {got}')
    if not any(message["role"] == "assistant" for message in messages):
        raise UsageError(f"{where}: no assistant message; SFT scores only the assistant's turns, so it teaches nothing")
    return messages


def encode_chat(tok, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """One chat's token ids, rendered with the tokenizer's own chat template, and its mask: 1 on the tokens
    of every assistant turn, 0 elsewhere and always on the first token.

    A turn's characters are what rendering the chat through it adds to rendering it up to the turn's
    generation prompt; a token is the turn's when it starts there (the tokenizer's offsets). So a turn
    is the reply, its end-of-turn marker and whatever the template writes after the marker (ChatML's
    newline after <|im_end|>): the rule needs no list of markers, and that newline always follows the
    marker, so it costs one near-certain target per reply and is never generated (decoding stops at
    the marker). README.md, "Fine-tuning on chats", says the same.
    """
    from jinja2 import TemplateError

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tok.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation_prompt)
        except (TemplateError, ValueError) as error:  # the template's raise_exception, or a Jinja error
            raise UsageError(f"{where}: the tokenizer's chat template refused this chat: {error}") from None

    text, spans = render(len(messages), False), []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before, through = render(i, True), render(i + 1, False)
            if not (through.startswith(before) and text.startswith(through)):
                raise UsageError(
                    f"{where}: the chat template renders message {i + 1} (assistant) differently once the chat goes "
                    "on (it rewrites earlier turns), so that turn's tokens cannot be found: use a chat template that "
                    "renders earlier turns as they are (TROUBLESHOOTING.md)"
                )
            spans.append((len(before), len(through)))
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    if len(mask) < 2 or not any(mask[1:]):
        raise UsageError(f"{where}: its assistant turns render to no tokens after the first; nothing would be scored")
    mask[0] = 0  # an example's first token would be predicted from the previous example's last
    return encoded["input_ids"], mask


def prepare_sft(
    jsonl: Path, tokenizer: Path, out: Path, val_fraction: float = 0.01, seed: int = 0, seq_len: int = SEQ_LEN
) -> int:
    """Render every chat of a JSONL file with the tokenizer's chat template and pack them, in file order,
    into a token file and its mask of scored targets (mask_path); a held-out share of the rows (picked at
    random with `seed`) goes to val.bin and its mask beside it, and must hold one window of `seq_len` + 1
    tokens (what validation reads). Return the training token count.

    Every row is read and checked before anything is written.
    """
    chats = read_chats(jsonl)  # before the tokenizer loads: a bad row is refused at once
    tok = load_tokenizer(tokenizer, extra="sft")
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"--tokenizer {tokenizer} has no chat template (chat_template in tokenizer_config.json)")
    if not tok.is_fast:
        raise UsageError(f"--tokenizer {tokenizer} is not a fast tokenizer (tokenizer.json): its offsets are needed")
    examples = [encode_chat(tok, messages, where) for where, messages in chats]
    held_out: set[int] = set()
    if val_fraction > 0:
        order = np.random.default_rng(seed).permutation(len(examples))
        check_held_out_window([len(examples[i][0]) for i in order], val_fraction, seq_len)
        held_out = set(order[: held_out_count(len(examples), val_fraction)].tolist())
    splits = {out: [e for i, e in enumerate(examples) if i not in held_out]}
    if held_out:
        splits[out.with_name("val.bin")] = [examples[i] for i in sorted(held_out)]
    dtype, written = token_dtype(tok), []
    with Outputs([p for path in splits for p in (path, mask_path(path))]) as outputs:
        for path, part in splits.items():
            ids, mask = [t for e in part for t in e[0]], [m for e in part for m in e[1]]
            outputs.write(path, np.asarray(ids, dtype=dtype))
            outputs.write(mask_path(path), np.asarray(mask, dtype=np.uint8))
            written.append(f"wrote {len(part)} chats, {len(ids)} {dtype.name} tokens ({sum(mask)} scored), to {path} "
                           f"and {mask_path(path)} (data.dtype = {dtype.name!r})")  # fmt: skip
        outputs.commit()
    print("\n".join(written))
    return sum(len(e[0]) for e in splits[out])
