"""Data-path benchmarks of a rendered CPU project, each a ratio measured side by side in this one run.

    python bench/data.py --json bench/results/data.json   # 6 minutes on 2 cores at load 4; prints a Markdown table
    python bench/data.py --quick                          # every row on small corpora and short runs
    python bench/data.py --from-json bench/results/data.json   # the README's table, from the recorded figures

1. Reading a sample: the time per window of one global batch (64 windows of 2,048 + 1 tokens, the
   render's own data/) from uint16 token files of 10 M, 100 M and 1 B tokens (sparse files), as a
   ratio to 10 M; and one rank's read of a step at world size 8 over world size 1.
2. `data prepare`: tokens/s against `datasets.map(batched=True)` with the same tokenizer (a byte-level
   BPE trained here) and process count, on the same JSON Lines corpus; and the peak resident memory
   of a prepare of a corpus 4x larger over that of the smaller one.
3. Data wait as a share of the step: the ViT debug model on 2 ranks reading an image folder (the
   token files of a decoder cost microseconds a step, images a decode and a resize each), with the
   batches built ahead (data.prefetch = 2, the default) and without (data.prefetch = 0).

The quick mode (tests/test_bench.py runs it) measures the same rows on smaller corpora, fewer reads
and shorter runs: it checks the harness, and its figures mean nothing. Timings vary with the machine,
named by the line under the table; the ratios are what the README records.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import env_for, ratio_row, render, run_cpu_bench, table

# What tests/test_bench.py reads of every benchmark: its rows, its table and its command line.
__all__ = ["ROWS", "main", "table"]

SEQ_LEN, GLOBAL_BATCH = 2048, 64
CORPUS_TOKENS = {"10 M": 10**7, "100 M": 10**8, "1 B": 10**9}
PROCESSES = 2
"""The processes of data prepare and of datasets.map, one thread each."""
ROWS = [
    "time per window read, 100 M-token file / 10 M",
    "time per window read, 1 B-token file / 10 M",
    "one rank's read of a step, world size 8 / world size 1",
    f"data prepare tokens/s / datasets.map(batched=True), {PROCESSES} processes",
    "data prepare peak resident memory, 4x the corpus / 1x",
    "data wait share of the step, ViT debug model on an image folder at world size 2: prefetch on / off",
]


def read_seconds_per_window(project: Path, tmp: Path, steps: int, rounds: int) -> tuple[dict, tuple[float, float]]:
    """Seconds per window of a global batch read from each sparse token file (the fastest of `rounds` rounds of
    `steps` steps, the files taking turns); and the seconds of rank 0's read of a step at world size 8 and 1.

    Each round reads its steps twice and times the second pass: the pages are in memory at every
    size, so the figure is the data path's own cost (a page not yet in memory costs one read from
    disk, the same at any file size, as MADV_RANDOM keeps the kernel from reading ahead).
    """
    sys.path.insert(0, str(project / "src"))
    from bench_pkg.data import MemmapTokens, Steps

    reads = {}
    for name, tokens in CORPUS_TOKENS.items():
        path = tmp / f"tokens_{tokens}.bin"
        with path.open("wb") as f:
            f.truncate(2 * tokens)  # uint16 zeros, no disk used
        source = MemmapTokens(path, "uint16", SEQ_LEN, seed=0)
        reads[name] = Steps(source, rank=0, per_rank=GLOBAL_BATCH, global_batch_size=GLOBAL_BATCH, rank_sharded=False)
    reads["world size 8"] = Steps(source, rank=0, per_rank=GLOBAL_BATCH // 8, global_batch_size=GLOBAL_BATCH,
                                  rank_sharded=False)  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in reads}
    for r in range(rounds):
        for name, read in reads.items():
            for step in range(r * steps, (r + 1) * steps):  # the pages into memory first, at every size alike
                read[step]
            started = time.perf_counter()
            for step in range(r * steps, (r + 1) * steps):
                read[step]
            times[name].append((time.perf_counter() - started) / steps)
    step = {name: min(seconds) for name, seconds in times.items()}  # the least disturbed round
    per_window = {name: step[name] / GLOBAL_BATCH for name in CORPUS_TOKENS}
    return per_window, (step["world size 8"], step["1 B"])


def write_corpus(path: Path, rows: int, seed: int) -> None:
    """JSON Lines of text: words drawn from a Zipf-like vocabulary of 5,000 made-up words (the same for every
    corpus), 5 to 60 a row (drawn with `seed`)."""
    words_rng, rng = np.random.default_rng(0), np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocabulary = ["".join(words_rng.choice(letters, size=words_rng.integers(2, 10))) for _ in range(5000)]
    weights = 1 / np.arange(1, 5001)
    lengths = rng.integers(5, 60, size=rows)
    words = np.split(rng.choice(5000, size=lengths.sum(), p=weights / weights.sum()), np.cumsum(lengths)[:-1])
    with path.open("w") as f:
        for row in words:
            f.write(json.dumps({"text": " ".join(vocabulary[w] for w in row)}) + "\n")


def train_tokenizer(corpus: Path, out: Path) -> None:
    """A byte-level BPE of 4,096 tokens, trained on the corpus's first 5,000 rows (nothing is downloaded)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    rows = [json.loads(line)["text"] for _, line in zip(range(5000), corpus.open(), strict=False)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=4096, special_tokens=["</s>"], show_progress=False)
    tok.train_from_iterator(rows, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(out)


PREPARE = """
import resource, sys, time
from pathlib import Path
from bench_pkg.data import prepare


def peak() -> int:
    # The largest resident set of this process (VmHWM: ru_maxrss would keep the benchmark's own from before the
    # exec) and of its workers (reaped, they are its children).
    own = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return 1024 * max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


tokenizer, processes, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
for corpus in sys.argv[4:]:  # smallest first: the peak only grows
    started = time.perf_counter()
    tokens = prepare(corpus, tokenizer, out, val_fraction=0, processes=processes)
    print(time.perf_counter() - started, tokens, peak())
"""


def prepare_runs(project: Path, corpora: list[Path], tokenizer: Path, processes: int) -> list[tuple[float, int, int]]:
    """Seconds, tokens written and the peak resident bytes so far (the largest of its processes) of a `data
    prepare` of each corpus in turn, in one process: from the JSON Lines file to the token file, the imports not
    timed. The peak after a larger corpus over that after a smaller one is what the corpus adds."""
    cmd = [sys.executable, "-c", PREPARE, str(tokenizer), str(processes), str(corpora[0].with_suffix(".bin")),
           *map(str, corpora)]  # fmt: skip
    done = subprocess.run(cmd, cwd=project, env=env_for(project), capture_output=True, text=True, check=True)
    lines = [line.split() for line in done.stdout.splitlines() if len(line.split()) == 3]
    return [(float(seconds), int(tokens), int(peak)) for seconds, tokens, peak in lines]


DATASETS_MAP = """
import sys, time
from datasets import load_dataset
from transformers import AutoTokenizer

corpus, tokenizer, processes = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(tokenizer)
eos = [tok.eos_token_id]

def encode(batch):
    return {"ids": [ids + eos for ids in tok(batch["text"], return_attention_mask=False)["input_ids"]]}

started = time.perf_counter()
rows = load_dataset("json", data_files=corpus, split="train")  # JSON Lines into Arrow: map needs it
encoded = rows.map(encode, batched=True, num_proc=processes if processes > 1 else None, remove_columns=["text"],
                   load_from_cache_file=False)
seconds = time.perf_counter() - started
print(seconds, sum(len(ids) for ids in encoded["ids"]))
"""


def datasets_map_run(project: Path, corpus: Path, tokenizer: Path, processes: int) -> tuple[float, int]:
    """Seconds and tokens of the same corpus through load_dataset("json") and datasets.map(batched=True), whose
    Arrow cache holds the ids (not yet one token file)."""
    cache = tempfile.mkdtemp(dir=corpus.parent, prefix="hf_cache")  # a fresh cache: nothing from an earlier run
    env = {**env_for(project), "HF_DATASETS_CACHE": cache}
    if processes > 1:
        env["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as data prepare's workers
    done = subprocess.run([sys.executable, "-c", DATASETS_MAP, str(corpus), str(tokenizer), str(processes)],
                          cwd=project, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    seconds, tokens = done.stdout.split()[-2:]
    return float(seconds), int(tokens)


def data_wait_shares(project: Path, images: Path, tmp: Path, steps: int) -> dict[int, float]:
    """Median share of the step the loop waited for its batch, by data.prefetch (2, then 0): the ViT debug model
    on 2 ranks reading an image folder (decoding and resizing are the data work a step waits for)."""
    shares = {}
    for prefetch in (2, 0):
        run = tmp / f"wait_prefetch{prefetch}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "bench_vit.train", "--config", str(project / "configs" / "debug.toml"), "--device", "cpu",
               "--run_dir", str(run), "--metrics.progress_bar", "False", "--data.source", "image_folder",
               "--data.path", str(images), "--data.prefetch", str(prefetch), "--train.steps", str(steps),
               "--eval.interval", "0", "--eval.fraction", "0", "--checkpoint.interval", "100000",
               "--checkpoint.export", "none", "--metrics.backend", "none"]  # fmt: skip
        done = subprocess.run(cmd, cwd=project, env=env_for(project), capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"training failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        shares[prefetch] = statistics.median(r["data_wait_s"] / r["step_time_s"] for r in records[3:])  # warm
    return shares


def write_images(root: Path, count: int) -> None:
    """JPEG photos' worth of decoding: `count` noisy 256 x 256 images in 4 class folders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        (root / f"class{i % 4}").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"class{i % 4}" / f"{i:04d}.jpg", quality=90)


def measure(quick: bool) -> list[dict]:
    rows = 8_000 if quick else 200_000
    started = time.perf_counter()

    def done(what: str) -> None:
        print(f"{time.perf_counter() - started:6.1f} s  {what}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        project = tmp / "cpu"
        render(project, {"accelerator": "cpu", "model_size": "debug", "package_name": "bench_pkg"})
        done("rendered")
        per_window, (rank_of_8, rank_of_1) = read_seconds_per_window(
            project, tmp, steps=5 if quick else 20, rounds=5 if quick else 25
        )
        done("read windows")
        small, large = tmp / "small.jsonl", tmp / "large.jsonl"
        write_corpus(small, rows // 4, seed=0)
        write_corpus(large, rows, seed=1)
        train_tokenizer(large, tmp / "tokenizer")
        done("corpus and tokenizer")
        ours, theirs = [], []
        for _ in range(1 if quick else 3):  # taking turns, the fastest of each: the least disturbed
            (_, _, small_peak), run = prepare_runs(project, [small, large], tmp / "tokenizer", PROCESSES)
            ours.append((*run, small_peak))
            theirs.append(datasets_map_run(project, large, tmp / "tokenizer", PROCESSES))
        (ours_s, tokens, large_peak, small_peak), (map_s, map_tokens) = min(ours), min(theirs)
        assert map_tokens == tokens, (map_tokens, tokens)  # the same ids, counted both ways
        done("data prepare and datasets.map")
        vit = tmp / "vit"
        render(vit, {"accelerator": "cpu", "model_type": "vit", "model_size": "vit-debug", "package_name": "bench_vit"})
        write_images(tmp / "images", 64)
        wait = data_wait_shares(vit, tmp / "images", tmp, steps=5 if quick else 30)  # past the 4 warm-up steps
        done("data wait")
    us = {name: seconds * 1e6 for name, seconds in per_window.items()}
    prepare = ratio_row(ROWS[3], tokens / ours_s, tokens / map_s,
                        f"{tokens / ours_s:,.0f} / {tokens / map_s:,.0f} tokens/s", "about 1 or more")  # fmt: skip
    prepare["figures"] |= {"tokens": tokens, "rows": rows}
    return [
        ratio_row(ROWS[0], us["100 M"], us["10 M"], f"{us['100 M']:.1f} us / {us['10 M']:.1f} us", "about 1"),
        ratio_row(ROWS[1], us["1 B"], us["10 M"], f"{us['1 B']:.1f} us / {us['10 M']:.1f} us", "<= 1.2"),
        ratio_row(ROWS[2], rank_of_8, rank_of_1, f"{rank_of_8 * 1e6:.0f} us / {rank_of_1 * 1e6:.0f} us",
                  "< 1 (1/8 plus the per-step lookup)"),
        prepare,
        ratio_row(ROWS[4], large_peak, small_peak, f"{large_peak / 2**20:.0f} MiB / {small_peak / 2**20:.0f} MiB",
                  "<= 1.1"),
        ratio_row(ROWS[5], wait[2], wait[0], f"{100 * wait[2]:.2f}% / {100 * wait[0]:.2f}%", "< 1"),
    ]  # fmt: skip


def main() -> None:
    run_cpu_bench("data", __doc__, "smaller corpora and shorter runs: every row, noisier", measure)


if __name__ == "__main__":
    main()
