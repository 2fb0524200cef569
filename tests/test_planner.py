"""The memory planner: hand-computed figures, and question time (hooks/plan.jinja) agreeing with
run time (the generated plan package) on a grid of inputs."""

from __future__ import annotations

import ast
import functools
import importlib
import itertools
import json
import math
import random
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml
from conftest import JINJA, TEMPLATE, hook, render

PRESETS = JINJA.get_template("hooks/presets.jinja").module.LLAMA_PRESETS
GIB = 2**30


def jinja(macro: str, *args):
    return hook("plan", macro, *args)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The generated plan package, imported from a render: an hf_causal_lm one, whose registry has llama too."""
    answers = {"accelerator": "cpu", "package_name": "planpkg", "model_type": "hf_causal_lm"}
    root = render(tmp_path_factory.mktemp("plan") / "p", answers)
    sys.path.insert(0, str(root / "src"))
    try:
        yield importlib.import_module("planpkg.plan")
    finally:
        sys.path.remove(str(root / "src"))


def model_config(size: str, **fields):
    """Preset `size`'s hyperparameters (llama's, or those of the model `fields` names), as a render reads them."""
    from planpkg.models import model_spec

    shapes = {k: v for k, v in PRESETS[size].items() if k not in ("seq_len", "micro_batch_size")}
    return model_spec(fields.get("name", "llama")).config(**shapes | fields)


def subs(cfg) -> dict:
    """The sub-configs of `cfg` that the plan package's functions take."""
    return dict(model=cfg.model, train=cfg.train, parallel=cfg.parallel, hardware=cfg.hardware, finetune=cfg.finetune,
                checkpoint=cfg.checkpoint)  # fmt: skip


def shape(plan, preset: str, **fields):
    """The preset's sizes and cost terms as its model module declares them (llama's, or the model `fields` name)."""
    from planpkg.models import model_shape

    return model_shape(model_config(preset, **fields))


def test_llama_8b_on_8_gpus_by_hand(plan):
    # Llama 3.1 8B: embeddings and head 2 x 128256 x 4096, final norm 4096 ...
    Pn = 2 * 128256 * 4096 + 4096  # 1,050,677,248
    # ... 32 blocks of wq, wo (4096^2), wk, wv (4096 x 1024), three SwiGLU matrices (4096 x 14336), two norms.
    Pb = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # 218,112,000
    P = 32 * Pb + Pn
    assert P == 8_030_261_248  # the published parameter count
    s = shape(plan, "8b")
    assert (s.P, s.Pb, s.Pn) == (P, Pb, Pn)
    # 8 GPUs, bf16 compute, full sharding, no activation checkpointing, 1 x 8192 tokens per rank, the logits whole.
    m = plan.memory_plan(s, seq_len=8192, micro_batch_size=1, precision="bf16", ac="none", sharding="full",
                         cpu_offload=False, gpus_per_node=8, num_nodes=1, loss_chunk=0)  # fmt: skip
    assert m.params == 4 * P / 8 == 4_015_130_624  # fp32 shards (the master weights)
    assert m.grads == 4 * P / 8 and m.optim == 8 * P / 8  # fp32 gradient shards, AdamW's two moments
    assert m.grads_live == 0  # one micro-batch: zero_grad(set_to_none) freed them before the forward
    assert m.gathered == 2 * Pb * 2 + Pn * 2 == 2_973_802_496  # two bf16 blocks in flight + embeddings/head
    assert m.gradbuf == Pb * (2 + 4)  # one block's bf16 gradient and its fp32 reduce-scatter input
    per_token_layer = 16 * 4096 + 2 * (5 * 4096 + 2 * 1024 + 4 * 14336)  # 225,280 bytes
    logits = 128256 * (2 + 12)
    assert m.activations == 8192 * (32 * per_token_layer + logits) == 73_765_224_448
    assert m.total == pytest.approx(90_093_090_816)  # 83.9 GiB: does not fit 80 GiB ...
    assert not m.fits(80)
    sel = plan.memory_plan(s, seq_len=8192, micro_batch_size=1, precision="bf16", ac="selective", sharding="full",
                           cpu_offload=False, gpus_per_node=8, num_nodes=1, loss_chunk=0)  # fmt: skip
    assert sel.fits(80)  # ... selective checkpointing keeps matmul outputs only and does
    # torchtitan measured 82.4 GiB for 8B on 8 H100s at 2 x 8192 tokens per rank with selective AC and the logits
    # whole (benchmarks/llama3_h100_202412_torchtitan.md); the plan is within 15% of that.
    two = plan.memory_plan(s, seq_len=8192, micro_batch_size=2, precision="bf16", ac="selective", sharding="full",
                           cpu_offload=False, gpus_per_node=8, num_nodes=1, loss_chunk=0)  # fmt: skip
    assert two.total / GIB == pytest.approx(82.4, rel=0.15)
    # The loss in chunks of 2,048 positions (the default, train.loss_chunk): one chunk's fp32 logits and their bf16
    # copy, the hidden states' gradient, four floats per position and the head's bf16 weight gradient, in place of
    # 14 bytes per logit: 1.58 + 0.07 + 0.0001 + 1.05 GB against 14.7 GB; without checkpointing the step still
    # needs 72.7 GiB, just over the 72 GiB the headroom leaves of 80.
    chunked = plan.memory_plan(s, seq_len=8192, micro_batch_size=1, precision="bf16", ac="none", sharding="full",
                               cpu_offload=False, gpus_per_node=8, num_nodes=1)  # fmt: skip
    loss = 2048 * 128256 * (4 + 2) + 8192 * (4096 * 2 + 16) + 128256 * 4096 * 2
    assert chunked.activations == 8192 * 32 * per_token_layer + loss == 61_749_723_136
    assert m.activations - chunked.activations == 12_015_501_312
    assert round(chunked.total / GIB, 1) == 72.7 and not chunked.fits(80)


def test_offload_moves_the_model_state_to_the_host(plan):
    s = shape(plan, "70b")
    kw = dict(
        seq_len=8192, micro_batch_size=1, precision="bf16", ac="full", sharding="full", gpus_per_node=8, num_nodes=1
    )
    on, off = plan.memory_plan(s, cpu_offload=False, **kw), plan.memory_plan(s, cpu_offload=True, **kw)
    assert off.host == 16 * s.P / 8
    assert on.total - off.total == pytest.approx(12 * s.P / 8)


def test_explicit_prefetch_holds_more_gathered_blocks(plan):
    s = shape(plan, "8b")
    kw = dict(seq_len=8192, micro_batch_size=1, precision="bf16", ac="full", cpu_offload=False, gpus_per_node=8,
              num_nodes=1)  # fmt: skip
    implicit, one, three = (plan.memory_plan(s, sharding="full", prefetch_blocks=n, **kw) for n in (0, 1, 3))
    assert implicit.gathered == one.gathered == 2 * s.Pb * 2 + s.Pn * 2  # running block + the one prefetched
    assert three.gathered - implicit.gathered == 2 * s.Pb * 2  # two more bf16 blocks
    # shard_grad_op keeps every block gathered from forward to backward anyway.
    assert plan.memory_plan(s, sharding="shard_grad_op", prefetch_blocks=3, **kw).gathered == s.P * 2


def test_accumulation_without_sync_keeps_unsharded_gradients(plan):
    s = shape(plan, "1b")
    kw = dict(
        seq_len=4096, micro_batch_size=1, precision="bf16", ac="none", cpu_offload=False, gpus_per_node=8, num_nodes=1
    )
    assert plan.memory_plan(s, sharding="full", grad_accum=4, **kw).grads_live == 4 * s.P
    assert (
        plan.memory_plan(s, sharding="full", grad_accum=4, sync_every_microbatch=True, **kw).grads_live == 4 * s.P / 8
    )
    assert plan.memory_plan(s, sharding="full", grad_accum=1, **kw).grads_live == 0


def test_lora_on_llama_8b_on_8_gpus_by_hand(plan):
    s = shape(plan, "8b")
    rank = HOOKS.LORA["rank"]
    assert (rank, HOOKS.LORA["targets"]) == (16, "all")
    # Rank 16 on wq, wo (4096 -> 4096), wk, wv (4096 -> 1024) and the three SwiGLU matrices (4096 <-> 14336).
    Ab = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert plan.adapter_params(s, rank, "all") == Ab == 1_310_720 and 32 * Ab == 41_943_040  # 0.52% of 8B
    kw = dict(seq_len=8192, micro_batch_size=1, precision="bf16", ac="selective", sharding="full", cpu_offload=False,
              gpus_per_node=8, num_nodes=1)  # fmt: skip
    full, lora = plan.memory_plan(s, **kw), plan.memory_plan(s, lora_rank=rank, **kw)
    A = 32 * Ab
    assert lora.params == (2 * s.P + 4 * A) / 8  # frozen weights in bf16, fp32 adapters
    assert lora.grads == 4 * A / 8 and lora.optim == 8 * A / 8
    assert lora.gathered == 2 * (s.Pb + Ab) * 2 + s.Pn * 2 and lora.gradbuf == Ab * (2 + 4)
    # Selective recomputes the adapters' matmuls; the chunked loss sums no gradient for the frozen head.
    assert lora.activations == full.activations - 128256 * 4096 * 2
    state = {name: m.params + m.grads + m.optim for name, m in (("full", full), ("lora", lora))}
    assert state["full"] - state["lora"] == pytest.approx((14 * s.P - 16 * A) / 8)  # 16 P / 8 against (2 P + 16 A) / 8
    assert (round(state["full"] / GIB, 1), round(state["lora"] / GIB, 1)) == (15.0, 1.9)
    # Every block without recomputation: the norms keep only their fp32 input, each adapter its rank-16 output.
    none = dict(kw, ac="none")
    per_token = 8 * 4096 + 2 * (5 * 4096 + 2 * 1024 + 4 * 14336 + 7 * 16)
    loss = 2048 * 128256 * (4 + 2) + 8192 * (4096 * 2 + 16)  # the loss in chunks of 2,048 positions
    assert plan.memory_plan(s, lora_rank=rank, **none).activations == 8192 * 32 * per_token + loss
    # Communication: the frozen weights are gathered twice as before, only the adapters' gradients are reduced.
    sent = plan.communication_bytes(s, "full", "bf16", 8, 1, lora_rank=rank)["intra"]
    assert sent == pytest.approx((2 * (32 * (s.Pb + Ab) + s.Pn) * 2 + 4 * A) * 7 / 8)


# The grid with the finetune answer: a seeded half of it (shuffled, so no other factor decides
# which half) keeps the run time of the grid without it.
GRID = random.Random(0).sample(list(itertools.product(
    PRESETS, ["bf16", "fp16", "fp32"], ["none", "selective", "full"], ["full", "shard_grad_op", "hybrid", "no_shard"],
    [False, True], [(1, 1), (8, 1), (8, 4)], [1, 4], [False, True], [False, True], [0, 3], ["full", "lora"],
)), 20736)  # fmt: skip


def test_question_time_and_run_time_degrees_agree(plan):
    # hooks/plan.jinja's parallel_degrees and the render's distributed.parallel_degrees (its Degrees): the same
    # arguments, the same fields and properties, on every split of 1 to 16 ranks the planner or a job can ask for.
    distributed = importlib.import_module("planpkg.distributed")
    checked = 0
    for sharding, (world, per_node), tp, cp, ep, shard_size in itertools.product(
        ["full", "shard_grad_op", "hybrid", "no_shard"], [(1, 1), (2, 2), (8, 8), (16, 8), (12, 4), (6, 3)],
        [1, 2, 4], [1, 2, 4], [1, 2], [0, 2],
    ):  # fmt: skip
        q = json.loads(jinja("parallel_degrees", sharding, world, per_node, tp, cp, ep, shard_size))
        r = distributed.parallel_degrees(sharding, world_size=world, ranks_per_node=per_node, tp=tp, cp=cp, ep=ep,
                                         hsdp_shard_size=shard_size)  # fmt: skip
        python = {**asdict(r), "dp": r.dp, "shard_group": r.shard_group, "efsdp": r.efsdp}
        assert q == python, (sharding, world, per_node, tp, cp, ep, shard_size)
        checked += 1
    assert checked == 4 * 6 * 3 * 3 * 2 * 2


# What derives one degree from others (a rank count divided: `world // tp`, `gpus_per_node // tp`; or anything divided
# by a product of degrees: `// (tp * cp)`), in the question-time Jinja and the docs it renders. The render's Python
# has its own scan (tests/test_degrees.py, generated).
DEGREE_ARITHMETIC = re.compile(
    r"\b(world|world_size|gpus_per_node|num_nodes|per_node|ranks_per_node)\)?\s*//"
    r"|//\s*\(\s*[\w.]*(tp|tensor_parallel)\s*\*\s*[\w.]*(cp|context_parallel)"
)


def test_each_planner_macro_is_a_function_of_the_render_by_the_same_name(plan, moe):
    # One vocabulary: every macro of hooks/plan.jinja but the formatting ones names a function (or the method the
    # table at its top names) of the generated package, and the Python plan/ mentions no macro by another name.
    text = (TEMPLATE / "hooks" / "plan.jinja").read_text()
    macros = [
        name for name in re.findall(r"\{%- macro (\w+)\(", text) if name[0] != "_" and name not in ("gib", "size")
    ]
    moepkg = moe[0]
    shape = importlib.import_module("moepkg.models.qwen3_moe.shape")
    where = [plan, importlib.import_module("planpkg.distributed"), importlib.import_module("planpkg.models"), shape]
    named = {"moe_activation_bytes": shape.MoeShape.activation_bytes}
    missing = [name for name in macros if name not in named and not any(hasattr(module, name) for module in where)]
    assert not missing and len(macros) == 31, (missing, macros)
    answers = (TEMPLATE / "hooks" / "answers.jinja").read_text()
    assert "macro largest_fitting_micro_batch(" in answers and hasattr(moepkg.choice, "largest_fitting_micro_batch")
    for name in macros:
        assert name in text[: text.index("-#}")], f"{name} is missing from the table at the top of hooks/plan.jinja"


def test_question_time_derives_degrees_in_parallel_degrees_only():
    found = []
    for path in [
        TEMPLATE / "copier.yml",
        *(TEMPLATE / "hooks").glob("*.jinja"),
        *(TEMPLATE / "template").rglob("*.md.jinja"),
    ]:
        text = path.read_text()
        if path.name == "plan.jinja":  # the macro itself
            start = text.index("{%- macro parallel_degrees(")
            text = text[:start] + text[text.index("{%- endmacro -%}", start) :]
        found += [f"{path.relative_to(TEMPLATE)}: {line.strip()[:80]}" for line in text.splitlines()
                  if DEGREE_ARITHMETIC.search(line)]  # fmt: skip
    assert not found, found
    assert DEGREE_ARITHMETIC.search("{%- set dp = world // tp -%}")
    assert DEGREE_ARITHMETIC.search("mbs * world // (tensor_parallel * context_parallel)")
    assert not DEGREE_ARITHMETIC.search("{{ m.n_heads // tp }} of the {{ seq_len // (2 * cp) }}")


def test_question_time_and_run_time_memory_agree(plan):
    # plan.jinja's memory_plan (with model_shape, activation_bytes_per_token, adapter_params, block_gather_bytes and
    # parallel_degrees) against plan/memory.py's memory_plan on the shape models/llama/shape.py declares.
    fields = ["params", "grads", "optim", "grads_live", "gathered", "gradbuf", "activations", "host", "parked", "total"]
    checked = {"full": 0, "lora": 0}
    for preset, precision, ac, sharding, offload, (gpus, nodes), accum, sync, zero, prefetch, finetune in GRID:
        if sharding == "no_shard" and (offload or prefetch) or sharding != "no_shard" and zero:
            continue
        seq, mbs = PRESETS[preset]["seq_len"], PRESETS[preset]["micro_batch_size"]
        q = json.loads(
            jinja(
                "memory_plan",
                preset,
                seq,
                mbs,
                precision,
                ac,
                sharding,
                offload,
                gpus,
                nodes,
                accum,
                sync,
                zero,
                prefetch,
                "none",
                finetune,
            )  # fmt: skip
        )
        r = plan.memory_plan(shape(plan, preset), seq_len=seq, micro_batch_size=mbs, precision=precision, ac=ac,
                             sharding=sharding, cpu_offload=offload, gpus_per_node=gpus, num_nodes=nodes,
                             grad_accum=accum, sync_every_microbatch=sync, zero_optimizer=zero,
                             prefetch_blocks=prefetch, lora_rank=HOOKS.LORA["rank"] if finetune == "lora" else 0,
                             lora_targets=HOOKS.LORA["targets"])  # fmt: skip
        for name in fields:
            assert q[name] == pytest.approx(getattr(r, name), rel=1e-12), (preset, precision, ac, sharding, name)
        checked[finetune] += 1
    assert checked["full"] > 2000 and checked["lora"] > 2000, checked


def test_question_time_and_run_time_recommendations_agree(plan, tmp_path):
    # plan.jinja's recommend (over cheapest and sharding_candidates) against plan/choice.py's of the same names.
    from planpkg.config import Config, FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig

    differ = 0
    for preset, precision, (gpus, nodes), memory, link, finetune in itertools.product(
        PRESETS, ["bf16", "fp32"], [(1, 1), (2, 1), (8, 1), (8, 2)], [16, 24, 40, 80, 141], ["infiniband", "ethernet"],
        ["full", "lora"],
    ):  # fmt: skip
        p = PRESETS[preset]
        cfg = Config(
            model=model_config(preset, preset=preset),
            train=TrainConfig(seq_len=p["seq_len"], micro_batch_size=p["micro_batch_size"],
                              global_batch_size=p["micro_batch_size"] * gpus * nodes),
            parallel=ParallelConfig(mixed_precision=precision),
            hardware=HardwareConfig(accelerator="cuda", gpus_per_node=gpus, num_nodes=nodes, gpu_memory_gb=memory,
                                    inter_node_link=link if nodes > 1 else ""),
            finetune=FinetuneConfig(method=finetune),
        )  # fmt: skip
        q = jinja(
            "recommend", preset, p["seq_len"], p["micro_batch_size"], precision, gpus, nodes, memory, link, "cuda",
            finetune,
        )  # fmt: skip
        r = ",".join(str(choice).lower() for choice in plan.recommend(**subs(cfg)))  # ac,sharding,offload,parked
        assert q == r, (preset, precision, gpus, nodes, memory, link, finetune)
        if finetune == "lora":
            without = jinja("recommend", preset, p["seq_len"], p["micro_batch_size"], precision, gpus, nodes, memory,
                            link, "cuda")  # fmt: skip
            differ += q != without
    assert differ > 20, differ  # LoRA's smaller model state changes the planner's pick


def test_question_time_and_run_time_communication_agree(plan):
    # plan.jinja's communication_bytes against plan/communication.py's.
    checked = 0
    for preset, sharding, precision, (gpus, nodes), zero, finetune in itertools.product(
        PRESETS,
        ["full", "shard_grad_op", "hybrid", "no_shard"],
        ["bf16", "fp32"],
        [(1, 1), (8, 1), (8, 4)],
        [False, True],
        ["full", "lora"],
    ):
        if zero and sharding != "no_shard":
            continue
        q = json.loads(jinja("communication_bytes", preset, sharding, precision, gpus, nodes, zero, "none", finetune))
        rank = HOOKS.LORA["rank"] if finetune == "lora" else 0
        r = plan.communication_bytes(shape(plan, preset), sharding, precision, gpus, nodes, zero, lora_rank=rank)
        assert q == pytest.approx(r, rel=1e-12), (preset, sharding, precision, gpus, nodes, zero, finetune)
        checked += 1
    assert checked > 200
    # ZeRO adds one broadcast of the fp32 parameters to DDP's all-reduce: 3 instead of 2 times 4P (N-1)/N.
    s = shape(plan, "8b")
    ddp, zero = (plan.communication_bytes(s, "no_shard", "bf16", 8, 1, z)["intra"] for z in (False, True))
    assert zero / ddp == pytest.approx(1.5) and ddp == pytest.approx(2 * 4 * s.P * 7 / 8)


def test_float8_all_gather_is_counted_alike_at_question_and_run_time(plan):
    # block_gather_bytes with float8, in plan.jinja's memory_plan and communication_bytes and plan/'s.
    checked = 0
    for preset, sharding, recipe in itertools.product(
        PRESETS, ["full", "shard_grad_op", "hybrid", "no_shard"], ["none", "tensorwise", "rowwise"]
    ):
        seq, mbs = PRESETS[preset]["seq_len"], PRESETS[preset]["micro_batch_size"]
        q = json.loads(jinja("memory_plan", preset, seq, mbs, "bf16", "selective", sharding, False, 8, 2, 1, False,
                             False, 0, recipe))  # fmt: skip
        r = plan.memory_plan(shape(plan, preset), seq_len=seq, micro_batch_size=mbs, precision="bf16",
                             ac="selective", sharding=sharding, cpu_offload=False, gpus_per_node=8, num_nodes=2,
                             float8=recipe)  # fmt: skip
        assert q["gathered"] == pytest.approx(r.gathered, rel=1e-12) and q["total"] == pytest.approx(r.total, rel=1e-12)
        qc = json.loads(jinja("communication_bytes", preset, sharding, "bf16", 8, 2, False, recipe))
        assert qc == pytest.approx(plan.communication_bytes(shape(plan, preset), sharding, "bf16", 8, 2, False, recipe))
        checked += 1
    assert checked == len(PRESETS) * 12
    # Llama 3.1 8B, full sharding: two blocks gathered at one byte per linear weight instead of two.
    s = shape(plan, "8b")
    kw = dict(seq_len=8192, micro_batch_size=1, precision="bf16", ac="selective", sharding="full", cpu_offload=False,
              gpus_per_node=8, num_nodes=1)  # fmt: skip
    bf16, f8 = plan.memory_plan(s, **kw), plan.memory_plan(s, float8="tensorwise", **kw)
    assert bf16.gathered - f8.gathered == 2 * (s.Pb - 2 * 4096) == 2 * (218_112_000 - 8192)
    assert plan.memory_plan(s, float8="rowwise", **kw).gathered == bf16.gathered  # rowwise gathers bf16


def test_tensor_parallel_splits_what_one_rank_holds_by_hand(plan):
    # Llama 3.1 70B on 4 nodes x 8 GPUs, 4 x 8192 tokens per group of 4 GPUs, full recomputation.
    s = shape(plan, "70b")
    kw = dict(seq_len=8192, micro_batch_size=4, precision="bf16", ac="full", sharding="full", cpu_offload=False,
              gpus_per_node=8, num_nodes=4)  # fmt: skip
    one, four = plan.memory_plan(s, **kw), plan.memory_plan(s, tensor_parallel=4, **kw)
    assert four.params == one.params == 4 * s.P / 32  # 8 data-parallel ranks x 4: still 1/32 of the state each
    assert four.gathered == one.gathered / 4 and four.gradbuf == one.gradbuf / 4  # the gathered blocks are split
    # Per token and block: the norms (fp32, sequence-split), 2h gathered inputs kept whole, the rest split.
    h, kv, f = 8192, 1024, 28672
    none = plan.activation_bytes_per_token(s, "bf16", "none", tensor_parallel=4)
    assert none == 16 * h / 4 + 2 * (2 * h + (3 * h + 2 * kv + 4 * f) / 4) == 136_192
    assert plan.activation_bytes_per_token(s, "bf16", "selective", tensor_parallel=4) == 74_752
    assert plan.activation_bytes_per_token(s, "bf16", "full", tensor_parallel=4) == 2 * h / 4
    # The loss in chunks of 2,048 positions on each rank's quarter of the vocabulary (loss parallelism): a chunk's
    # fp32 logits and their bf16 copy and the head's weight gradient split 4 ways; the hidden states' gradient and
    # four floats per position whole.
    tokens = 4 * 8192
    loss = (2048 * 128256 * (4 + 2) + 128256 * 8192 * 2) / 4 + tokens * (8192 * 2 + 16)
    assert four.activations == tokens * (80 * 4096 + 136_192) + loss == 16_656_891_904
    whole_logits = plan.memory_plan(s, tensor_parallel=4, loss_chunk=0, **kw).activations
    assert whole_logits == tokens * (80 * 4096 + 136_192 + 128256 * (2 + 12))  # the logits whole on every rank
    # Without sequence parallelism the norms and each block's input stay whole.
    whole = functools.partial(plan.activation_bytes_per_token, s, "bf16", tensor_parallel=4, sequence_parallel=False)
    assert whole("none") == 16 * h + 2 * (2 * h + (3 * h + 2 * kv + 4 * f) / 4) == 234_496
    assert whole("selective") == 2 * (3 * h + (2 * h + 2 * kv + 2 * f) / 4) == 87_040
    assert whole("full") == 2 * h
    # transformers' decoder layers (models/hf_causal_lm/) under their own plan, which splits no sequence: their
    # norms keep the fp32 input and the normalised output in bf16 (8h + 2 x 2h, whole), the inputs of the split
    # matmuls are whole (2h), and no copy of the attention output is kept.
    theirs = functools.partial(plan.activation_bytes_per_token, shape(plan, "70b", name="hf_causal_lm"), "bf16",
                               tensor_parallel=4, sequence_parallel=False)  # fmt: skip
    assert theirs("none") == 8 * h + 2 * (4 * h + (2 * h + 2 * kv + 4 * f) / 4) == 197_632
    assert (theirs("selective"), theirs("full")) == (whole("selective"), whole("full"))
    four_whole = plan.memory_plan(s, tensor_parallel=4, sequence_parallel=False, **kw)
    assert four_whole.activations - four.activations == tokens * (80 * (2 * h - 2 * h / 4) + 234_496 - 136_192)
    # FSDP moves 1/4 of the parameters among 8 data-parallel ranks: 2P (two bf16 gathers + fp32 grads) x 7/8.
    sent = plan.communication_bytes(s, "full", "bf16", 8, 4, tensor_parallel=4)
    assert sent == {"intra": 0.0, "inter": 2 * s.P * 7 / 8}
    # Tensor parallelism's own traffic, Llama 3.1 8B in pairs: 16384 tokens x 2 bytes x (4096 x (8 x 32 + 4)
    # hidden states + 128256 logits) x 1/2.
    assert plan.tensor_parallel_bytes(shape(plan, "8b"), "bf16", "none", 2, 16384) == 19_549_650_944


def degrees_of(plan, cfg) -> list[int]:
    return plan.tensor_parallel_degrees(model=cfg.model, train=cfg.train, hardware=cfg.hardware)


def estimate(plan, cfg, degree: int, base_micro_batch: int):
    return plan.estimate_tensor_parallel(**subs(cfg), degree=degree, base_micro_batch=base_micro_batch)


def best_degree(plan, cfg, base_micro_batch: int) -> int:
    return plan.recommend_tensor_parallel(**subs(cfg), base_micro_batch=base_micro_batch)


def hardware_config(preset, precision, gpus, nodes, memory, intra, inter, arch, **model_fields):
    from planpkg.config import Config, HardwareConfig, ParallelConfig, TrainConfig

    p = PRESETS[preset]
    return Config(
        model=model_config(preset, preset=preset, **model_fields),
        train=TrainConfig(seq_len=p["seq_len"], micro_batch_size=p["micro_batch_size"],
                          global_batch_size=p["micro_batch_size"] * gpus * nodes),
        parallel=ParallelConfig(mixed_precision=precision),
        hardware=HardwareConfig(accelerator="cuda", gpu_arch=arch, gpus_per_node=gpus, num_nodes=nodes,
                                gpu_memory_gb=memory, intra_node_link=intra if gpus > 1 else "",
                                inter_node_link=inter if nodes > 1 else ""),
    )  # fmt: skip


def test_tensor_parallel_is_recommended_where_fsdp_alone_is_communication_bound(plan):
    # One H100 node, Llama 3.1 8B: FSDP alone fits and its 0.28 s of traffic hides behind 1.0 s of compute.
    cfg = hardware_config("8b", "bf16", 8, 1, 80, "nvlink", "", "hopper")
    assert degrees_of(plan, cfg) == [1, 2, 4, 8]
    one = estimate(plan, cfg, 1, 1)
    assert one.fsdp_s < one.compute_s and best_degree(plan, cfg, 1) == 1
    # Four Blackwell nodes on InfiniBand, Llama 3.1 70B: FSDP alone sends 8P x 31/32 bytes per rank and step
    # over 25 GB/s, four times its compute; groups of 4 divide that by 4 for 2.6 s of their own on NVLink.
    cfg = hardware_config("70b", "bf16", 8, 4, 180, "nvlink", "infiniband", "blackwell")
    one, four = estimate(plan, cfg, 1, 1), estimate(plan, cfg, 4, 1)
    assert one.fsdp_s == pytest.approx(8 * shape(plan, "70b").P * 31 / 32 / 25e9) and one.fsdp_s > 4 * one.compute_s
    assert (four.micro_batch_size, four.cpu_offload, four.tokens) == (4, False, one.tokens)  # the same global batch
    assert four.step_s < one.step_s / 2 and best_degree(plan, cfg, 1) == 4
    # Where every degree needs CPU offload, offload decides nothing and 1 stays the cheapest (70B on one node).
    cfg = hardware_config("70b", "bf16", 8, 1, 80, "nvlink", "", "hopper")
    assert estimate(plan, cfg, 8, 1).cpu_offload and best_degree(plan, cfg, 1) == 1
    # Ethernet between nodes makes even 8B communication-bound: groups of 8, whose ranks fit 8 sequences a
    # micro-batch with the loss in chunks (train.loss_chunk); with the logits whole they fit 4, and groups of 4 win.
    ethernet = hardware_config("8b", "bf16", 8, 4, 80, "nvlink", "ethernet", "hopper")
    assert best_degree(plan, ethernet, 1) == 8 and estimate(plan, ethernet, 8, 1).micro_batch_size == 8
    ethernet.train.loss_chunk = 0
    assert best_degree(plan, ethernet, 1) == 4 and estimate(plan, ethernet, 8, 1).micro_batch_size == 4
    # Heads decide which degrees exist: 125m has 12 heads, so 8 is out.
    assert degrees_of(plan, hardware_config("125m", "bf16", 8, 1, 80, "nvlink", "", "hopper")) == [1, 2, 4]


TP_GRID = list(itertools.product(
    [p for p in PRESETS if p != "debug"], ["bf16", "fp32"], ["none", "selective", "full"],
    ["full", "shard_grad_op", "hybrid"], [False, True], [(8, 1), (8, 4)], [2, 8], [1, 4],
))  # fmt: skip


def test_question_time_and_run_time_agree_with_tensor_parallelism(plan):
    # memory_plan, communication_bytes and tensor_parallel_bytes with a tensor-parallel degree: plan.jinja's and
    # plan/memory.py's, plan/communication.py's.
    fields = ["params", "grads", "optim", "grads_live", "gathered", "gradbuf", "activations", "host", "total"]
    checked, split = 0, set()
    for i, (preset, precision, ac, sharding, offload, (gpus, nodes), tp, accum) in enumerate(TP_GRID):
        seq, mbs = PRESETS[preset]["seq_len"], PRESETS[preset]["micro_batch_size"]
        # llama's blocks and plan (sequence parallelism) or transformers' (hf_causal_lm), by the parity of the
        # index's bits: each half of the grid still spans every other choice, and the grid takes no longer.
        sp = bin(i).count("1") % 2 == 0
        q = json.loads(jinja("memory_plan", preset, seq, mbs, precision, ac, sharding, offload, gpus, nodes, accum,
                             False, False, 0, "none", "full", tp, sp))  # fmt: skip
        s = shape(plan, preset) if sp else shape(plan, preset, name="hf_causal_lm")
        r = plan.memory_plan(s, seq_len=seq, micro_batch_size=mbs, precision=precision, ac=ac,
                             sharding=sharding, cpu_offload=offload, gpus_per_node=gpus, num_nodes=nodes,
                             grad_accum=accum, tensor_parallel=tp, sequence_parallel=sp)  # fmt: skip
        for name in fields:
            assert q[name] == pytest.approx(getattr(r, name), rel=1e-12), (preset, precision, ac, tp, sp, name)
        split |= {(axis, value, sp) for axis, value in enumerate(TP_GRID[i])}
        qc = json.loads(
            jinja("communication_bytes", preset, sharding, precision, gpus, nodes, False, "none", "full", tp)
        )
        rc = plan.communication_bytes(shape(plan, preset), sharding, precision, gpus, nodes, tensor_parallel=tp)
        assert qc == pytest.approx(rc, rel=1e-12), (preset, sharding, precision, gpus, nodes, tp)
        qt = float(jinja("tensor_parallel_bytes", preset, precision, ac, tp, seq * mbs))
        assert qt == pytest.approx(plan.tensor_parallel_bytes(shape(plan, preset), precision, ac, tp, seq * mbs))
        checked += 1
    assert checked == len(TP_GRID) > 1000
    assert {(axis, value) for axis, value, sp in split if sp} == {(axis, value) for axis, value, sp in split if not sp}


def tp_recommendations(plan, grid, model_type: str, **model_fields) -> set[int]:
    """Check that question time and run time agree on each hardware of `grid`: the degrees, the pick and
    every degree's estimate; return the degrees picked."""
    picked = set()
    for preset, (gpus, nodes), memory, intra, inter in grid:
        if nodes == 1 and inter == "ethernet":
            continue
        p = PRESETS[preset]
        cfg = hardware_config(preset, "bf16", gpus, nodes, memory, intra, inter, "hopper", **model_fields)
        degrees = jinja("tensor_parallel_degrees", preset, p["seq_len"], gpus, "cuda", model_type)
        assert degrees == ",".join(map(str, degrees_of(plan, cfg)))
        q = jinja("recommend_tensor_parallel", preset, p["seq_len"], p["micro_batch_size"], "bf16", gpus, nodes, memory,
                  intra, inter, "cuda", "hopper", model_type)  # fmt: skip
        r = best_degree(plan, cfg, p["micro_batch_size"])
        assert int(q) == r, (preset, gpus, nodes, memory, intra, inter)
        for t in degrees_of(plan, cfg):
            qe = json.loads(jinja("estimate_tensor_parallel", preset, p["seq_len"], p["micro_batch_size"], "bf16", gpus,
                                  nodes, memory, intra, inter, "cuda", "hopper", t, 0,
                                  model_type == "llama"))  # fmt: skip
            re_ = estimate(plan, cfg, t, p["micro_batch_size"])
            assert bool(qe) == (re_ is not None)
            if re_ is not None:
                assert (qe["micro_batch_size"], qe["ac"], qe["sharding"], qe["offload"], qe["activation_offload"]) == (
                    re_.micro_batch_size,
                    re_.ac,
                    re_.sharding,
                    re_.cpu_offload,
                    re_.activation_offload,
                )
                assert qe["seconds_per_token"] == pytest.approx(re_.seconds_per_token, rel=1e-12)
        picked.add(r)
    return picked


def test_question_time_and_run_time_tensor_parallel_recommendations_agree(plan):
    # tensor_parallel_degrees, estimate_tensor_parallel and recommend_tensor_parallel: plan.jinja's, plan/choice.py's.
    grid = list(itertools.product(
        ["1b", "8b", "70b"], [(4, 1), (8, 1), (8, 4)], [24, 80, 180], ["nvlink", "pcie"], ["infiniband", "ethernet"]
    ))  # fmt: skip
    assert len(grid) == 108 and tp_recommendations(plan, grid, "llama") == {1, 2, 4, 8}  # the grid reaches every degree


def test_transformers_tensor_parallel_plans_are_planned_alike_at_question_and_run_time(plan):
    # model.name=hf_causal_lm: transformers' plans keep the activations between the blocks whole (no sequence
    # parallelism), so its estimates are its own; its degrees do not depend on the sequence length.
    grid = itertools.product(["8b", "70b"], [(8, 1), (8, 4)], [80, 180], ["nvlink"], ["infiniband", "ethernet"])
    assert tp_recommendations(plan, grid, "hf_causal_lm", name="hf_causal_lm") == {1, 2, 8}
    # Whole activations cost memory. Llama 3.1 70B on 4 nodes of 8 x 80 GiB with the logits whole: the built-in
    # model's pairs take their two sequences without CPU offload; transformers' pairs take only one (two would need
    # offload, and a larger micro-batch is no reason to offload), so its groups of 8 send the fewest bytes a token.
    llama, hf = (hardware_config("70b", "bf16", 8, 4, 80, "nvlink", "infiniband", "hopper", name=name)
                 for name in ("llama", "hf_causal_lm"))  # fmt: skip
    llama.train.loss_chunk = hf.train.loss_chunk = 0
    ours, theirs = estimate(plan, llama, 2, 1), estimate(plan, hf, 2, 1)
    assert (ours.cpu_offload, theirs.cpu_offload) == (False, False), (ours, theirs)
    assert (ours.micro_batch_size, theirs.micro_batch_size) == (2, 1), (ours, theirs)
    assert (best_degree(plan, llama, 1), best_degree(plan, hf, 1)) == (2, 8)


def test_context_parallel_splits_the_activations_of_llama_8b_at_131072_tokens_by_hand(plan):
    # Llama 3.1 8B on 8 x H100 at its whole context: one 131,072-token sequence per group of 8, full recomputation,
    # shard_grad_op (the planner's pick at question time). Each GPU holds 16,384 of the sequence's tokens.
    s = shape(plan, "8b")
    h, kv, f, V = 4096, 1024, 14336, 128256
    kw = dict(seq_len=131072, micro_batch_size=1, precision="bf16", ac="full", sharding="shard_grad_op",
              cpu_offload=False, gpus_per_node=8, num_nodes=1)  # fmt: skip
    whole = dict(kw, loss_chunk=0)  # the logits whole, as before train.loss_chunk
    one, eight = plan.memory_plan(s, **whole), plan.memory_plan(s, context_parallel=8, **whole)
    # The model state is sharded over the same 8 ranks either way (FSDP shards over dp_shard x cp).
    assert (eight.params, eight.optim, eight.gathered) == (one.params, one.optim, one.gathered)
    # Per token a rank holds: the block inputs (2h bytes each), the block recomputed in backward, the logits.
    # 8 divides the 8 key/value heads: attention keeps them as they are.
    recomputed = 16 * h + 2 * (5 * h + 2 * kv + 4 * f)
    assert plan.activation_bytes_per_token(s, "bf16", "none", context_parallel=8) == recomputed
    assert eight.activations == 16384 * (32 * 2 * h + recomputed + V * (2 + 12)) == 37_404_803_072
    assert one.activations == 8 * eight.activations
    assert round(one.total / GIB, 1) == 306.1 and round(eight.total / GIB, 1) == 62.2 and eight.fits(80)
    # Without context parallelism the least any plan needs (full sharding with offload) is what the question
    # refused before: "'seq_len': 8192 tokens fit: 131072 need 282.7 GiB per GPU, 72.0 usable".
    least = plan.memory_plan(s, **{**whole, "sharding": "full", "cpu_offload": True})
    assert round(least.total / GIB, 1) == 282.7
    # The loss in chunks of 2,048 positions (the default): 29.4 GB of logits per GPU at CP 8 become one chunk's
    # 1.6 GB, the hidden states' gradient, four floats per position and the head's gradient (2.8 GB in all).
    eight = plan.memory_plan(s, context_parallel=8, **kw)
    loss = 2048 * V * (4 + 2) + 16384 * (2 * h + 16) + V * h * 2
    assert eight.activations == 16384 * (32 * 2 * h + recomputed) + loss == 10_747_117_568
    assert round(eight.total / GIB, 1) == 37.4
    # ... and without context parallelism the least plan fits: 66.9 GiB, with CPU offload.
    least = plan.memory_plan(s, **{**kw, "sharding": "full", "cpu_offload": True})
    assert round(least.total / GIB, 1) == 66.9 and least.fits(80)
    # Key/value heads that a degree does not divide are repeated to the query heads: with tensor parallelism 2
    # a rank holds 4 of them, and 8 ranks of context parallelism would need 8 (the degrees it has are 2 and 4;
    # with 4 they divide). Selective checkpointing keeps the all-to-alls' outputs, p (2h + 2g) / t more.
    assert plan.activation_bytes_per_token(s, "bf16", "selective", tensor_parallel=2, context_parallel=4) == (
        plan.activation_bytes_per_token(s, "bf16", "selective", tensor_parallel=2) + 2 * (2 * h + 2 * kv) / 2
    )
    s70 = shape(plan, "70b")  # 8 key/value heads; with tensor parallelism 4, 2 a rank: 4 ranks repeat them
    g = 8192  # h: repeated
    assert plan.activation_bytes_per_token(s70, "bf16", "none", tensor_parallel=4, context_parallel=2) == (
        plan.activation_bytes_per_token(s70, "bf16", "none", tensor_parallel=4)
    )
    assert plan.activation_bytes_per_token(s70, "bf16", "none", tensor_parallel=2, context_parallel=8) == (
        16 * g / 2 + 2 * (2 * g + (3 * g + 2 * g + 4 * 28672) / 2)
    )
    # The all-to-alls of one 131,072-token sequence: q, k, v and the output per block (2h + 2kv values per token a
    # rank holds), forward, backward and the forward again under full recomputation, 7/8 of it to the others.
    sent = plan.context_parallel_bytes(s, "bf16", "full", 1, 8, 131072)
    assert sent == 16384 * 2 * (2 * h + 2 * kv) * 3 * 32 * 7 / 8 == 28_185_722_880


CP_GRID = list(itertools.product(
    [p for p in PRESETS if p != "debug"], ["bf16", "fp32"], ["none", "selective", "full"],
    ["full", "shard_grad_op", "hybrid"], [False, True], [(8, 1), (8, 2)], [(1, 2), (1, 8), (2, 2), (2, 4)],
    ["full", "lora"],
))  # fmt: skip


def test_question_time_and_run_time_agree_with_context_parallelism(plan):
    # memory_plan and context_parallel_bytes with a context-parallel degree: plan.jinja's and plan/'s (the activations
    # as models/llama/shape.py declares them).
    fields = ["params", "grads", "optim", "grads_live", "gathered", "gradbuf", "activations", "host", "total"]
    checked = 0
    for preset, precision, ac, sharding, offload, (gpus, nodes), (tp, cp), finetune in CP_GRID:
        if tp > 1 and finetune == "lora":
            continue  # the trainer refuses LoRA with tensor parallelism
        seq, mbs = 4 * PRESETS[preset]["seq_len"], 1
        q = json.loads(jinja("memory_plan", preset, seq, mbs, precision, ac, sharding, offload, gpus, nodes, 1, False,
                             False, 0, "none", finetune, tp, True, cp))  # fmt: skip
        r = plan.memory_plan(shape(plan, preset), seq_len=seq, micro_batch_size=mbs, precision=precision, ac=ac,
                             sharding=sharding, cpu_offload=offload, gpus_per_node=gpus, num_nodes=nodes,
                             lora_rank=HOOKS.LORA["rank"] if finetune == "lora" else 0,
                             lora_targets=HOOKS.LORA["targets"], tensor_parallel=tp,
                             context_parallel=cp)  # fmt: skip
        for name in fields:
            assert q[name] == pytest.approx(getattr(r, name), rel=1e-12), (preset, precision, ac, tp, cp, name)
        qc = float(jinja("context_parallel_bytes", preset, precision, ac, tp, cp, seq * mbs))
        rc = plan.context_parallel_bytes(shape(plan, preset), precision, ac, tp, cp, seq * mbs)
        assert qc == pytest.approx(rc, rel=1e-12) and rc > 0, (preset, precision, ac, tp, cp)
        checked += 1
    assert checked > 1000
    # The grid holds key/value heads that split (8b, cp 8) and that are repeated (70b, tp 2 x cp 4: 4 heads a rank).
    assert plan.context_parallel_bytes(shape(plan, "70b"), "bf16", "none", 2, 4, 8192) > plan.context_parallel_bytes(
        shape(plan, "8b"), "bf16", "none", 2, 4, 8192
    )


def test_question_time_and_run_time_pick_the_same_context_parallel_degree(plan):
    # context_parallel_degrees and recommend_context_parallel: plan.jinja's and plan/choice.py's.
    picked = set()
    for preset, seq, (gpus, nodes), memory, tp in itertools.product(
        ["1b", "8b", "70b"], [8192, 32768, 131072], [(8, 1), (4, 2)], [40, 80, 141], [1, 2]
    ):
        cfg = hardware_config(preset, "bf16", gpus, nodes, memory, "nvlink", "infiniband", "hopper")
        cfg.train.seq_len, cfg.train.micro_batch_size = seq, 1
        cfg.parallel.tensor_parallel = tp
        q_degrees = jinja("context_parallel_degrees", preset, seq, gpus, tp, "cuda", "llama")
        r_degrees = plan.context_parallel_degrees(model=cfg.model, train=cfg.train, parallel=cfg.parallel,
                                                  hardware=cfg.hardware)  # fmt: skip
        assert q_degrees == ",".join(map(str, r_degrees)), (preset, seq, gpus, tp)
        q = jinja("recommend_context_parallel", preset, seq, 1, "bf16", gpus, nodes, memory, "infiniband", "cuda",
                  "llama", "full", tp)  # fmt: skip
        r = plan.recommend_context_parallel(**subs(cfg))
        assert int(q) == r, (preset, seq, gpus, nodes, memory, tp)
        picked.add(r)
    assert picked >= {1, 2, 4}, picked  # the grid needs no degree, some, and the most a node has
    # Other models, and CPU ranks, have only 1.
    assert jinja("context_parallel_degrees", "8b", 131072, 8, 1, "cuda", "hf_causal_lm") == "1"
    assert jinja("context_parallel_degrees", "8b", 131072, 8, 1, "cpu", "llama") == "1"
    # A degree must split the node, the heads (125m has 12) and the sequence into 2 x degree chunks.
    assert jinja("context_parallel_degrees", "125m", 2048, 8, 1, "cuda", "llama") == "1,2,4"
    assert jinja("context_parallel_degrees", "8b", 8200, 8, 1, "cuda", "llama") == "1,2,4"


def long_context_config(plan, preset: str, gpus: int, nodes: int, memory: int, tp: int = 1, cp: int = 1, seq: int = 0):
    """hardware_config at one sequence per micro-batch and step (no accumulation: the question-time plan's), split
    over tp x cp."""
    cfg = hardware_config(preset, "bf16", gpus, nodes, memory, "nvlink", "infiniband", "hopper")
    cfg.parallel.tensor_parallel, cfg.parallel.context_parallel = tp, cp
    cfg.train.micro_batch_size, cfg.train.seq_len = 1, seq or cfg.train.seq_len
    cfg.train.global_batch_size = plan.planned_degrees(parallel=cfg.parallel, hardware=cfg.hardware).dp
    return cfg


def test_question_time_and_run_time_find_the_same_longest_sequence(plan):
    # seq_len_multiple and longest_fitting_seq_len: plan.jinja's and plan/choice.py's. The length is the longest
    # multiple of the split's step that fits: the next one does not (a binary search, not the preset's halvings).
    found = set()
    for preset, (gpus, memory), (tp, cp) in itertools.product(
        ["1b", "8b", "70b"], [(8, 80), (8, 24), (1, 80), (1, 8)], [(1, 1), (2, 1), (1, 8), (2, 4)]
    ):
        if tp * cp > gpus:
            continue
        cfg = long_context_config(plan, preset, gpus, 1, memory, tp, cp)
        unit = plan.seq_len_multiple(model=cfg.model, parallel=cfg.parallel)
        assert int(jinja("seq_len_multiple", tp, cp, True)) == unit == (cp * max(tp, 2) if cp > 1 else tp)
        q = int(jinja("longest_fitting_seq_len", preset, 131072, 1, "bf16", gpus, 1, memory, "infiniband", "cuda",
                      "full", tp, 0, True, cp))  # fmt: skip
        r = plan.longest_fitting_seq_len(**subs(cfg), longest=131072)
        assert q == r, (preset, gpus, memory, tp, cp)
        step = math.lcm(unit, 128)
        assert r % step == 0

        def fits(seq, cfg=cfg):
            return plan.cheapest(**subs(cfg) | {"train": replace(cfg.train, seq_len=seq)}) is not None

        assert (r == 0 or fits(r)) and (r + step > 131072 or not fits(r + step)), (preset, gpus, memory, tp, cp, r)
        found.add("whole" if r == 131072 else "none" if r == 0 else "between")
        if r and r < 131072 and r & (r - 1):  # not a power of two: longer than the halving the planner offered before
            found.add("not a halving")
    assert found == {"whole", "none", "between", "not a halving"}, found
    # transformers' plans split no sequence: any length with tensor parallelism; the built-in decoder's, a multiple.
    assert jinja("seq_len_multiple", 4, 1, False) == "1" and jinja("seq_len_multiple", 4, 1, True) == "4"


def test_tensor_parallelism_is_planned_with_the_context_parallelism_a_long_sequence_needs(plan):
    # tensor_parallel_estimates and recommend_tensor_parallel: where no degree fits the sequence without context
    # parallelism, each degree is estimated with the smallest context-parallel degree that fits it, on both sides.
    picked = {}
    for preset, seq, nodes in [("8b", 131072, 1), ("8b", 131064, 1), ("70b", 131072, 8), ("8b", 32768, 2)]:
        cfg = long_context_config(plan, preset, 8, nodes, 80, seq=seq)
        base = PRESETS[preset]["micro_batch_size"]
        r_all = plan.tensor_parallel_estimates(**subs(cfg), base_micro_batch=base)
        q_all = json.loads(jinja("tensor_parallel_estimates", preset, seq, base, "bf16", 8, nodes, 80, "nvlink",
                                 "infiniband", "cuda", "hopper", "llama"))  # fmt: skip
        assert sorted(map(int, q_all)) == sorted(r_all), (preset, seq)
        for degree, r in r_all.items():
            q = q_all[str(degree)]
            assert bool(q) == (r is not None), (preset, seq, degree)
            if r is not None:
                assert (q["micro_batch_size"], q["ac"], q["sharding"], q["offload"]) == (
                    r.micro_batch_size, r.ac, r.sharding, r.cpu_offload)  # fmt: skip
                assert q["seconds_per_token"] == pytest.approx(r.seconds_per_token, rel=1e-12)
        q = int(jinja("recommend_tensor_parallel", preset, seq, base, "bf16", 8, nodes, 80, "nvlink", "infiniband",
                      "cuda", "hopper", "llama"))  # fmt: skip
        assert q == best_degree(plan, cfg, base)
        picked[(preset, seq, nodes)] = (q, {int(d): e.get("cp") for d, e in q_all.items() if e})
    # 131,072 tokens of 8b with the loss in chunks: FSDP alone over pairs of context-parallel GPUs (no offload, the
    # all-to-alls priced), before any tensor-parallel degree (which fits without it, at the cost of its collectives).
    assert picked[("8b", 131072, 1)] == (1, {1: 2, 2: 1, 4: 1, 8: 1})
    # 131,064 tokens: 2 x 2 divides them too (2 x 8 does not: context parallelism 2 is the smallest that fits).
    assert picked[("8b", 131064, 1)] == (1, {1: 2, 2: 1, 4: 1, 8: 1})
    # 70b at 131,072 tokens on 8 nodes: every degree with the context parallelism that fills the node's 8 GPUs.
    assert picked[("70b", 131072, 8)] == (1, {1: 8, 2: 4, 4: 2, 8: 1})
    # 8b at 32,768 tokens on 2 nodes: FSDP alone fits without it, so no degree is planned with it.
    assert picked[("8b", 32768, 2)] == (1, {1: 1, 2: 1, 4: 1, 8: 1})


def test_a_run_time_refusal_offers_the_longest_sequence_that_fits(plan):
    # Launched on 10 GiB devices, 8b planned at 131,072 tokens over context parallelism 8: no smaller micro-batch, no
    # larger degree and neither offload fit it (with the loss in chunks, 40 GiB take it with full recomputation), so
    # the longest sequence that fits (a multiple of 16 and 128), not a halving of it.
    cfg = long_context_config(plan, "8b", 8, 1, 80, 1, 8, 131072)
    fix = plan.check.device_fix(**subs(cfg), memory_gb=10)
    named = dict(re.findall(r"(train\.seq_len|parallel\.\w+)=(\w+)", fix))
    seq = int(named["train.seq_len"])
    live = replace(cfg.hardware, gpu_memory_gb=10)
    assert seq == plan.longest_fitting_seq_len(**subs(cfg) | {"hardware": live}, longest=131072), fix
    assert seq % 128 == 0 and 65536 < seq < 131072 and seq & (seq - 1), fix  # past the halving, 65,536


def test_host_memory_of_70b_on_one_24_gib_gpu_by_hand(plan):
    # Llama 3.1 70B fits one 24 GiB GPU only with CPU offload: its whole fp32 state goes to the host.
    s = shape(plan, "70b")
    P, V, h = s.P, 128256, 8192
    assert P == 70_553_706_496 and max(s.V * s.h, s.h * s.f) == V * h  # the embedding is the largest tensor
    kw = dict(seq_len=2048, micro_batch_size=1, precision="bf16", ac="full", sharding="full", cpu_offload=True,
              gpus_per_node=1, num_nodes=1)  # fmt: skip
    m = plan.memory_plan(s, **kw)
    host = plan.host_memory_plan(s, m, accelerator="cuda", precision="bf16", gpus_per_node=1, num_nodes=1,
                                 cpu_offload=True)  # fmt: skip
    assert host.state == 16 * P  # parameters, gradients, both AdamW moments: 1051.3 GiB
    # One embedding in transit; rank 0's seeded initial weights; the shards their broadcast fills before
    # loading them, in host memory like the parameters ...
    assert host.load == 4 * V * h + 4 * P + 4 * P
    assert host.start == host.load + 4 * P  # ... which exist already
    assert host.export == 2 * 5e9 + 2 * 4 * V * h  # one 5 GB export file copied and serialised; the joined tensor
    assert (host.runtime, host.os, host.device, host.staging) == (3 * GIB, 2 * GIB, 0, 0)
    assert host.total == 5 * GIB + 16 * P + 2 * 5e9 + 8 * V * h  # training, not loading, is the peak
    assert round(host.total / GIB, 1) == 1073.5
    assert not host.fits(256) and host.fits(2048) and host.fits(0)  # 0: no figure, nothing to check
    # dcp_async stages each rank's fp32 parameters and moments (12 P) too; LoRA from pretrained weights
    # keeps bf16 frozen weights, builds only the adapters on rank 0 and exports bf16.
    staged = plan.host_memory_plan(s, m, accelerator="cuda", precision="bf16", gpus_per_node=1, num_nodes=1,
                                   cpu_offload=True, checkpoint_format="dcp_async")  # fmt: skip
    assert staged.staging == 12 * P and staged.total - host.total == 12 * P
    rank = HOOKS.LORA["rank"]
    lora_m = plan.memory_plan(s, lora_rank=rank, **kw)
    lora = plan.host_memory_plan(s, lora_m, accelerator="cuda", precision="bf16", gpus_per_node=1, num_nodes=1,
                                 cpu_offload=True, lora_rank=rank, init_from=True)  # fmt: skip
    A = 80 * plan.adapter_params(s, rank, "all")
    assert lora.state == 2 * P + 16 * A and lora.load == 4 * V * h + 4 * A
    assert lora.export == 2 * 5e9 + 2 * 2 * V * h
    # On CPU ranks the device plan is host memory, and each rank receives the initial weights' broadcast
    # in it (two copies of the largest tensor in transit).
    cpu = plan.host_memory_plan(s, m, accelerator="cpu", precision="bf16", gpus_per_node=2, num_nodes=1,
                                cpu_offload=True)  # fmt: skip
    assert cpu.device == 2 * m.total and cpu.load == 2 * 2 * 4 * V * h + 4 * P + 2 * m.params
    assert cpu.export == 2 * 2 * 5e9 / 2 + 2 * 4 * V * h and cpu.runtime == 2 * GIB


def test_activation_offload_parks_the_inputs_of_all_blocks_but_two_by_hand(plan):
    from planpkg.config import HardwareConfig

    # Llama 3.1 8B at 131,072 tokens over a context-parallel group of 8 GPUs (16,384 tokens a GPU), bf16, full
    # checkpointing: each block keeps its input, 16,384 x 4,096 x 2 bytes (128 MiB). Offload parks 30 of the 32 in
    # host memory (the last two never leave the GPU: their backward comes first).
    s = shape(plan, "8b")
    kw = dict(seq_len=131072, micro_batch_size=1, precision="bf16", sharding="full", cpu_offload=False,
              gpus_per_node=8, num_nodes=1, context_parallel=8)  # fmt: skip
    kept, parked = (plan.memory_plan(s, ac="full", activation_offload=on, **kw) for on in (False, True))
    block_input = 16384 * 4096 * 2
    assert parked.parked == 30 * block_input == 4_026_531_840 and kept.parked == 0
    assert kept.activations - parked.activations == kept.total - parked.total == parked.parked
    # Selective checkpointing keeps the same inputs (and its matmul outputs, which stay); none keeps no input to park.
    selective = plan.memory_plan(s, ac="selective", activation_offload=True, **kw)
    assert selective.parked == parked.parked
    assert plan.memory_plan(s, ac="none", activation_offload=True, **kw).parked == 0
    # The node's RAM holds its 8 GPUs' parked inputs while training: 30 GiB more, the peak (with pretrained weights,
    # whose slices each rank reads, start-up holds less).
    host_kw = dict(accelerator="cuda", precision="bf16", gpus_per_node=8, num_nodes=1, cpu_offload=False,
                   init_from=True)  # fmt: skip
    without, with_parked = (plan.host_memory_plan(s, m, **host_kw) for m in (kept, parked))
    assert with_parked.parked == 8 * parked.parked and with_parked.training - without.training == 30 * GIB
    assert with_parked.total == with_parked.runtime + with_parked.os + with_parked.training
    assert "activation offload 30.0" in with_parked.describe()
    # Over the host link: each parked input to the host and back, 8.05 GB a step, 0.16 s at 50 GB/s (PCIe Gen5 x16 as
    # a pinned copy reaches it), hidden behind 2.0 s of compute at 40% MFU.
    sent = plan.activation_offload_bytes(s, "bf16", 16384, context_parallel=8)
    assert sent == 2 * parked.parked
    hopper = HardwareConfig(accelerator="cuda", gpu_arch="hopper", gpus_per_node=8)
    seconds = plan.activation_offload_seconds(sent, hardware=hopper)
    assert seconds == pytest.approx(sent / 50e9) == pytest.approx(0.161, abs=1e-3)
    assert 6 * s.P * 16384 / (0.4 * 989e12) > 10 * plan.activation_offload_seconds(sent, hardware=hopper)
    # Two blocks or fewer park nothing.
    assert plan.parked_bytes(shape(plan, "8b", n_layers=2), 16384, 8192) == 0


def test_the_planner_parks_block_inputs_before_it_offloads_the_model_state(plan):
    from planpkg.config import Config, HardwareConfig, ParallelConfig, TrainConfig

    # Llama 3.1 8B on its whole 131,072-token context on 8 x H100 80 GB, without context parallelism: with the blocks'
    # inputs kept no plan fits but CPU offload's (full sharding, full recomputation: 66.9 GiB of 72); parking them
    # fits with shard_grad_op (60.3 GiB), and its copies cross the host link where CPU offload would move the whole
    # sharded state and step AdamW on the CPU.
    cfg = Config(model=model_config("8b", preset="8b"),
                 train=TrainConfig(seq_len=131072, micro_batch_size=1, global_batch_size=8),
                 parallel=ParallelConfig(mixed_precision="bf16"),
                 hardware=HardwareConfig(accelerator="cuda", gpu_arch="hopper", gpus_per_node=8, gpu_memory_gb=80,
                                         intra_node_link="nvlink"))  # fmt: skip
    assert plan.cheapest(**subs(cfg)) == plan.PlanChoice("full", "shard_grad_op", False, True)
    assert jinja("recommend", "8b", 131072, 1, "bf16", 8, 1, 80, "", "cuda") == "full,shard_grad_op,false,true"
    assert plan.cheapest(**subs(cfg), activation_offload=False) == plan.PlanChoice("full", "full", True, False)
    chosen = replace(cfg.parallel, activation_checkpointing="full", sharding="shard_grad_op")
    args = dict(model=cfg.model, train=cfg.train, parallel=chosen, hardware=cfg.hardware, finetune=cfg.finetune)
    assert plan.needs_activation_offload(**args)
    assert round(plan.plan_for(**args, activation_offload=True).total / GIB, 1) == 60.3
    assert round(plan.plan_for(**args, activation_offload=False).total / GIB, 1) == 90.3
    # A config that leaves it off is refused at launch with that one setting as the fix.
    fix = plan.check.device_fix(**subs(replace(cfg, parallel=chosen)), memory_gb=80)
    assert fix.startswith("set parallel.activation_offload=true ("), fix


def test_question_time_and_run_time_agree_with_activation_offload(plan):
    # memory_plan's parked and activations, activation_offload_bytes and needs_activation_offload: plan.jinja's and
    # plan/memory.py's, plan/communication.py's, plan/choice.py's.
    from planpkg.config import Config, FinetuneConfig, HardwareConfig, ParallelConfig, TrainConfig

    fields = ["activations", "parked", "total"]
    needed = set()
    grid = itertools.product(["1b", "8b", "70b"], ["bf16", "fp32"], ["none", "selective", "full"], [1, 2], [1, 2, 8],
                             ["full", "lora"], [(8192, 40), (65536, 80)])  # fmt: skip
    for preset, precision, ac, tp, cp, finetune, (seq, memory) in grid:
        sp = cp % 2 == 1  # llama's sequence-parallel plan or transformers' (no context parallelism there)
        if tp > 1 and finetune == "lora" or not sp and cp > 1:
            continue
        rank = HOOKS.LORA["rank"] if finetune == "lora" else 0
        q = json.loads(jinja("memory_plan", preset, seq, 1, precision, ac, "full", False, 8, 1, 1, False, False, 0,
                             "none", finetune, tp, sp, cp, 1, HOOKS.LOSS_CHUNK, True))  # fmt: skip
        s = shape(plan, preset) if sp else shape(plan, preset, name="hf_causal_lm")
        r = plan.memory_plan(s, seq_len=seq, micro_batch_size=1, precision=precision, ac=ac, sharding="full",
                             cpu_offload=False, gpus_per_node=8, num_nodes=1, lora_rank=rank, tensor_parallel=tp,
                             sequence_parallel=sp, context_parallel=cp, activation_offload=True)  # fmt: skip
        for name in fields:
            assert q[name] == pytest.approx(getattr(r, name), rel=1e-12), (preset, precision, ac, tp, cp, name)
        tokens = seq // cp
        qb = float(jinja("activation_offload_bytes", preset, precision, tokens, tp, sp, cp))
        assert qb == pytest.approx(plan.activation_offload_bytes(s, precision, tokens, tp, sp, cp), rel=1e-12)
        cfg = Config(model=model_config(preset, preset=preset, **({} if sp else {"name": "hf_causal_lm"})),
                     train=TrainConfig(seq_len=seq, micro_batch_size=1, global_batch_size=8 // (tp * cp)),
                     parallel=ParallelConfig(mixed_precision=precision, activation_checkpointing=ac,
                                             tensor_parallel=tp, context_parallel=cp),
                     hardware=HardwareConfig(accelerator="cuda", gpus_per_node=8, gpu_memory_gb=memory,
                                             intra_node_link="nvlink"),
                     finetune=FinetuneConfig(method=finetune))  # fmt: skip
        qn = jinja("needs_activation_offload", preset, seq, 1, precision, ac, "full", False, 8, 1, memory, "cuda",
                   False, finetune, tp, sp, cp)  # fmt: skip
        rn = plan.needs_activation_offload(model=cfg.model, train=cfg.train, parallel=cfg.parallel,
                                           hardware=cfg.hardware, finetune=cfg.finetune)  # fmt: skip
        assert qn == str(rn).lower(), (preset, precision, ac, tp, cp, finetune, seq, memory)
        needed.add(rn)
    assert needed == {False, True}


MOE = JINJA.get_template("hooks/presets.jinja").module.MOE_PRESETS


@pytest.fixture(scope="module")
def moe(plan, tmp_path_factory):
    """The plan package of a mixture-of-experts render, whose registry has the qwen3_moe model, and a function that
    gives a MoE preset's shape as its module declares it."""
    answers = {"accelerator": "cpu", "package_name": "moepkg", "model_type": "qwen3_moe"}
    root = render(tmp_path_factory.mktemp("moe") / "p", answers)
    sys.path.insert(0, str(root / "src"))
    try:
        package = importlib.import_module("moepkg.plan")
        from moepkg.models import model_shape, model_spec

        def config(preset: str):
            fields = {k: v for k, v in MOE[preset].items() if k not in ("seq_len", "micro_batch_size")}
            return model_spec("qwen3_moe").config(**fields, preset=preset)

        yield package, config, lambda preset: model_shape(config(preset))
    finally:
        sys.path.remove(str(root / "src"))


def test_qwen3_30b_a3b_on_8_gpus_by_hand(moe):
    plan, _, shape_of = moe
    s = shape_of("30b-a3b")
    # 48 blocks: attention (q 32 x 128 = 4096 wide, 4 key/value heads of 128), two norms and two per-head norms,
    # a router (2048 x 128) and 128 experts of 3 x 2048 x 768; embedding and head 151936 x 2048, final norm.
    attention = 2 * 2048 * 4096 + 2 * 2048 * 512
    expert = 3 * 2048 * 768
    Pb = attention + 2048 * 128 + 128 * expert + 2 * 2048 + 2 * 128
    P = 48 * Pb + 2 * 151936 * 2048 + 2048
    assert (s.P, s.Pb, s.routed_params) == (P, Pb, 128 * expert) and P == 30_532_122_624  # "30.5B" as published
    assert s.active == P - 48 * 120 * expert == 3_353_032_704  # "3.3B activated": 8 of 128 experts a token
    # FLOPs per token (MFU) from the active parameters: 6 per multiplied weight (not the embedding), attention.
    assert s.flops_per_token(4096) == 6 * (s.active - 151936 * 2048) + 12 * 48 * 4096 * 4096
    kw = dict(seq_len=4096, micro_batch_size=1, precision="bf16", ac="selective", sharding="full", cpu_offload=False,
              gpus_per_node=8, num_nodes=1)  # fmt: skip
    one, eight = plan.memory_plan(s, **kw), plan.memory_plan(s, **kw, expert_parallel=8)
    # Every rank holds 1/8 of the state either way (16 bytes a parameter); expert parallelism changes what a
    # block gathers: its attention and router whole, 16 of its 128 experts.
    assert one.params + one.grads + one.optim == eight.params + eight.grads + eight.optim == 16 * P / 8
    assert one.gathered - eight.gathered == 2 * 2 * 128 * expert * 7 / 8  # two bf16 blocks in flight
    assert eight.gathered == 2 * 2 * (Pb - 112 * expert) + 2 * (2 * 151936 * 2048 + 2048)
    assert eight.gradbuf == (Pb - 112 * expert) * (2 + 4)
    assert eight.dispatch == 2 * 4096 * 8 * 2048 * 2 and one.dispatch == 0  # 4096 tokens x 8 copies, sent, received
    # The all-to-alls: each token's 8 copies of 2048 bf16 values to the other 7 ranks' experts and back, forward
    # and backward, in 48 layers: 22.5 GB a step on NVLink; FSDP gathers and reduces the experts among 1 rank.
    sent = plan.expert_parallel_bytes(s, "bf16", "selective", 8, 4096)
    assert sent == 4 * 4096 * 8 * 2048 * 2 * 7 / 8 * 48
    one_c, eight_c = (plan.communication_bytes(s, "full", "bf16", 8, 1, expert_parallel=e)["intra"] for e in (1, 8))
    assert one_c == (2 * 2 * P + 4 * P) * 7 / 8 and eight_c == (8 * P - 8 * 48 * 128 * expert) * 7 / 8


def moe_config(moe, preset, precision, gpus, nodes, memory, intra, inter, arch):
    from moepkg.config import Config, HardwareConfig, ParallelConfig, TrainConfig

    _, config, _ = moe
    m = MOE[preset]
    return Config(
        model=config(preset),
        train=TrainConfig(seq_len=m["seq_len"], micro_batch_size=m["micro_batch_size"],
                          global_batch_size=m["micro_batch_size"] * gpus * nodes),
        parallel=ParallelConfig(mixed_precision=precision),
        hardware=HardwareConfig(accelerator="cuda", gpu_arch=arch, gpus_per_node=gpus, num_nodes=nodes,
                                gpu_memory_gb=memory, intra_node_link=intra if gpus > 1 else "",
                                inter_node_link=inter if nodes > 1 else ""),
    )  # fmt: skip


def test_question_time_and_run_time_agree_for_a_mixture_of_experts(moe):
    # plan.jinja's moe_shape and moe_activation_bytes against models/qwen3_moe/shape.py's moe_shape and
    # MoeShape.activation_bytes, through memory_plan, communication_bytes and expert_parallel_bytes on both sides.
    plan, _, shape_of = moe
    fields = ["params", "grads", "optim", "grads_live", "gathered", "gradbuf", "activations", "host", "dispatch",
              "total"]  # fmt: skip
    checked = 0
    for preset, precision, ac, sharding, offload, (gpus, nodes), ep, accum in itertools.product(
        MOE, ["bf16", "fp32"], ["none", "selective", "full"], ["full", "shard_grad_op", "hybrid"], [False, True],
        [(2, 1), (8, 1), (8, 4)], [1, 2, 8], [1, 4],
    ):  # fmt: skip
        if ep > gpus:
            continue
        seq, mbs = MOE[preset]["seq_len"], MOE[preset]["micro_batch_size"]
        q = json.loads(jinja("memory_plan", preset, seq, mbs, precision, ac, sharding, offload, gpus, nodes, accum,
                             False, False, 0, "none", "full", 1, True, 1, ep))  # fmt: skip
        r = plan.memory_plan(shape_of(preset), seq_len=seq, micro_batch_size=mbs, precision=precision, ac=ac,
                             sharding=sharding, cpu_offload=offload, gpus_per_node=gpus, num_nodes=nodes,
                             grad_accum=accum, expert_parallel=ep)  # fmt: skip
        for name in fields:
            assert q[name] == pytest.approx(getattr(r, name), rel=1e-12), (preset, precision, ac, sharding, ep, name)
        qc = json.loads(
            jinja("communication_bytes", preset, sharding, precision, gpus, nodes, False, "none", "full", 1, ep)
        )
        rc = plan.communication_bytes(shape_of(preset), sharding, precision, gpus, nodes, expert_parallel=ep)
        assert qc == pytest.approx(rc, rel=1e-12), (preset, sharding, precision, gpus, nodes, ep)
        qa = float(jinja("expert_parallel_bytes", preset, precision, ac, ep, seq * mbs * accum))
        assert qa == pytest.approx(plan.expert_parallel_bytes(shape_of(preset), precision, ac, ep, seq * mbs * accum))
        checked += 1
    assert checked > 1000, checked


def test_question_time_and_run_time_expert_parallel_recommendations_agree(moe):
    # expert_parallel_degrees, estimate_expert_parallel and recommend_expert_parallel: plan.jinja's, plan/choice.py's.
    plan, _, _ = moe
    picked = set()
    grid = itertools.product(["30b-a3b", "235b-a22b"], [(2, 1), (8, 1), (8, 4)], [40, 80, 180], ["nvlink", "pcie"],
                             ["infiniband", "ethernet"])  # fmt: skip
    for preset, (gpus, nodes), memory, intra, inter in grid:
        if nodes == 1 and inter == "ethernet":
            continue
        m, cfg = MOE[preset], moe_config(moe, preset, "bf16", gpus, nodes, memory, intra, inter, "hopper")
        degrees = plan.expert_parallel_degrees(model=cfg.model, hardware=cfg.hardware)
        assert jinja("expert_parallel_degrees", preset, gpus, "cuda") == ",".join(map(str, degrees))
        args = dict(model=cfg.model, train=cfg.train, parallel=cfg.parallel, hardware=cfg.hardware,
                    finetune=cfg.finetune, checkpoint=cfg.checkpoint)  # fmt: skip
        for d in degrees:
            qe = json.loads(jinja("estimate_expert_parallel", preset, m["seq_len"], m["micro_batch_size"], "bf16", gpus,
                                  nodes, memory, intra, inter, "cuda", "hopper", d))  # fmt: skip
            re_ = plan.estimate_expert_parallel(**args, degree=d, base_micro_batch=m["micro_batch_size"])
            assert bool(qe) == (re_ is not None), (preset, gpus, nodes, memory, d)
            if re_ is not None:
                assert (qe["micro_batch_size"], qe["ac"], qe["sharding"], qe["offload"], qe["activation_offload"]) == (
                    re_.micro_batch_size, re_.ac, re_.sharding, re_.cpu_offload, re_.activation_offload)  # fmt: skip
                assert qe["seconds_per_token"] == pytest.approx(re_.seconds_per_token, rel=1e-12)
        q = int(jinja("recommend_expert_parallel", preset, m["seq_len"], m["micro_batch_size"], "bf16", gpus, nodes,
                      memory, intra, inter, "cuda", "hopper"))  # fmt: skip
        r = plan.recommend_expert_parallel(**args, base_micro_batch=m["micro_batch_size"])
        assert q == r, (preset, gpus, nodes, memory, intra, inter)
        picked.add(r)
    assert {2, 8} <= picked, picked  # the estimates reach several degrees


def ask(call: str, answers: dict, given: dict | None = None) -> str:
    """A validator or default of hooks/questions.jinja as copier renders it: `answers` so far in the context, and
    the answers `given` on the command line (as `-d` hands them over, strings) in `_copier_conf.data`."""
    macro = call.split("(")[0]
    template = JINJA.from_string(f"{{% from 'hooks/questions.jinja' import {macro} with context %}}{{{{ {call} }}}}")
    return template.render(**answers, _copier_conf={"data": given or {}})


# Issue 28's Volta case, up to the plan's questions: 8b on 8 x 32 GiB over PCIe, fp16.
VOLTA = {"accelerator": "cuda", "gpu_arch": "volta", "gpus_per_node": 8, "num_nodes": 1, "gpu_memory_gb": 32,
         "host_memory_gb": 512, "intra_node_link": "pcie", "inter_node_link": "infiniband", "mixed_precision": "fp16",
         "model_type": "custom", "finetune": "full", "model_size": "8b", "tensor_parallel": 1,
         "micro_batch_size": 1}  # fmt: skip


def test_a_refused_plan_choice_suggests_a_plan_that_fits_the_answers_given_and_its_figure(plan):
    # 49,152 tokens: at the default length (8,192) the loss in chunks leaves room to spare without offload, and at
    # 32,768 full recomputation with the blocks' inputs parked in host memory does.
    a = {**VOLTA, "seq_len": 49152}
    # In a terminal the later questions come after: the cheapest plan with full recomputation is the fix (the
    # refused question's own answer bare: the line of a disabled choice has no room for its name).
    assert ask("ac_choice('selective')", a).startswith("choose full: at best ")
    # Given DDP without the ZeRO optimizer and without offload on the command line, full recomputation alone
    # fits nothing (before: "choose activation_checkpointing=full: at best 42.7 GiB per GPU", selective's best
    # with any sharding): the fix names the answers it changes (so many that its figure has no room left).
    given = {"sharding": "no_shard", "cpu_offload": "false", "zero_optimizer": "false"}
    refusal = ask("ac_choice('selective')", a, given)
    assert refusal == "choose full, sharding=full and cpu_offload=true", refusal
    # Following half of the fix, the next refusal asks for the rest with the figure of the plan it suggests (before:
    # "choose sharding=full: at best 69.8", DDP's with the ZeRO optimizer the user had turned off).
    half = ask("sharding_choice('no_shard')", {**a, "activation_checkpointing": "full"}, given)
    fix = "choose full and cpu_offload=true: at best "
    assert half.startswith(fix) and half.endswith(" GiB/GPU"), half
    figure = float(half[len(fix) :].split()[0])
    m, kept = (plan.memory_plan(shape(plan, "8b"), seq_len=a["seq_len"], micro_batch_size=1, precision="fp16",
                                ac="full", sharding="full", cpu_offload=True, gpus_per_node=8, num_nodes=1,
                                activation_offload=parked) for parked in (True, False))  # fmt: skip
    assert figure == round(m.total / GIB, 1) and m.fits(32) and not kept.fits(32)  # its blocks' inputs parked too
    assert ask("offload_choice(false)", {**a, "activation_checkpointing": "full", "sharding": "full"}).startswith(
        f"choose cpu_offload=true ({figure} GiB): this needs "
    )


def test_run_time_refusals_name_only_fixes_that_fit(plan):
    def device(sub: dict):
        return plan.plan_for(**{k: v for k, v in sub.items() if k != "checkpoint"})

    # 8B planned for 8 x 80 GiB as DDP without recomputation, launched on 32 GiB devices: the settings the
    # refusal names fit them.
    cfg = hardware_config("8b", "bf16", 8, 1, 80, "nvlink", "", "hopper")
    sub = {**subs(cfg), "parallel": replace(cfg.parallel, sharding="no_shard", activation_checkpointing="none")}
    fix = plan.check.device_fix(**sub, memory_gb=32)
    named = {f"{a}.{b}": yaml.safe_load(v) for a, b, v in re.findall(r"(\w+)\.(\w+)=(\w+)", fix)}
    assert named and not device(sub).fits(32), fix
    for section in ("train", "parallel"):
        sub[section] = replace(sub[section], **{k.split(".")[1]: v for k, v in named.items() if k.startswith(section)})
    assert device(sub).fits(32), fix
    # A node short of RAM for 1B offloaded with async checkpoints: each change the refusal names fits it (and the
    # GPU); more nodes are named only with the number that does.
    tight = hardware_config("1b", "bf16", 8, 1, 80, "nvlink", "", "hopper")
    offloaded = {**subs(tight), "parallel": replace(tight.parallel, sharding="full", cpu_offload=True),
                 "checkpoint": replace(tight.checkpoint, format="dcp_async")}  # fmt: skip
    ram = plan.host_plan_for(**offloaded).total / GIB / 0.9 * 0.95
    fixes = plan.check_host_memory(**offloaded, ranks_per_node=8, ram_gib=ram).split("usable): ", 1)[1]
    changes = {
        "parallel.cpu_offload=false": {"parallel": replace(offloaded["parallel"], cpu_offload=False)},
        "checkpoint.format=dcp": {"checkpoint": replace(offloaded["checkpoint"], format="dcp")},
    }
    named = [change for change in changes if change in fixes]
    for change in named:
        fixed = {**offloaded, **changes[change]}
        assert plan.host_plan_for(**fixed).fits(ram) and device(fixed).fits(80), change
    if found := re.search(r"at most (\d+) ranks? per node", fixes):
        assert plan.host_plan_for(**offloaded, ranks_per_node=int(found.group(1))).fits(ram)
    assert named or found, fixes
    assert "nodes" not in fixes.replace("per node", "") or "hardware.num_nodes=" in fixes, fixes


# A seeded third of the grid (DDP with offload left out): every factor still meets every other.
HOST_GRID = random.Random(0).sample([c for c in itertools.product(
    PRESETS, ["cuda", "cpu"], ["bf16", "fp32"], ["full", "no_shard", "hybrid"], [False, True], [(1, 1), (8, 2)],
    ["full", "lora"], ["dcp", "dcp_async"], [False, True],
) if not (c[3] == "no_shard" and c[4])], 640)  # fmt: skip


def test_question_time_and_run_time_host_memory_agree(plan):
    # plan.jinja's host_memory_plan against plan/host.py's.
    fields = ["runtime", "state", "device", "staging", "load", "start", "export", "os", "parked", "total"]
    checked = 0
    for preset, accelerator, precision, sharding, offload, (gpus, nodes), finetune, fmt, export in HOST_GRID:
        seq, mbs = PRESETS[preset]["seq_len"], PRESETS[preset]["micro_batch_size"]
        rank = HOOKS.LORA["rank"] if finetune == "lora" else 0
        m = plan.memory_plan(shape(plan, preset), seq_len=seq, micro_batch_size=mbs, precision=precision, ac="full",
                             sharding=sharding, cpu_offload=offload, gpus_per_node=gpus, num_nodes=nodes,
                             lora_rank=rank, activation_offload=checked % 2 == 1)  # fmt: skip
        q = json.loads(jinja("host_memory_plan", preset, {**asdict(m), "total": m.total}, accelerator, precision, gpus,
                             nodes, offload, finetune, fmt, export, finetune == "lora"))  # fmt: skip
        r = plan.host_memory_plan(shape(plan, preset), m, accelerator=accelerator, precision=precision,
                                  gpus_per_node=gpus, num_nodes=nodes, cpu_offload=offload, lora_rank=rank,
                                  checkpoint_format=fmt, export=export, init_from=finetune == "lora")  # fmt: skip
        for name in fields:
            assert q[name] == pytest.approx(getattr(r, name), rel=1e-12), (preset, accelerator, sharding, fmt, name)
        checked += 1
    assert checked == len(HOST_GRID) == 640


def test_question_time_and_run_time_recommendations_agree_on_host_memory(plan):
    # cheapest with the node's RAM: plan.jinja's (host_memory_plan inside) and plan/choice.py's (host_plan_for).
    from planpkg.config import CheckpointConfig, Config, HardwareConfig, ParallelConfig, TrainConfig

    differ = refused = 0
    for preset, (gpus, nodes), memory, host, link, accelerator in itertools.product(
        ["1b", "8b", "70b"], [(1, 1), (8, 1), (8, 2)], [24, 80], [64, 512, 2048], ["infiniband", "ethernet"],
        ["cuda", "cpu"],
    ):  # fmt: skip
        if accelerator == "cpu" and (memory, link) != (24, "infiniband"):
            continue
        p = PRESETS[preset]
        cfg = Config(
            model=model_config(preset, preset=preset),
            train=TrainConfig(seq_len=p["seq_len"], micro_batch_size=p["micro_batch_size"],
                              global_batch_size=p["micro_batch_size"] * gpus * nodes),
            parallel=ParallelConfig(mixed_precision="bf16"),
            hardware=HardwareConfig(accelerator=accelerator, gpus_per_node=gpus, num_nodes=nodes,
                                    gpu_memory_gb=memory if accelerator != "cpu" else 0, host_memory_gb=host,
                                    inter_node_link=link if nodes > 1 else ""),
            checkpoint=CheckpointConfig(export="hf"),  # copier's search: an export, synchronous checkpoints
        )  # fmt: skip
        args = [preset, p["seq_len"], p["micro_batch_size"], "bf16", gpus, nodes, memory, link, accelerator]
        q = hook("plan", "recommend", *args, "full", 1, host)
        r = ",".join(str(choice).lower() for choice in plan.recommend(**subs(cfg)))  # ac,sharding,offload,parked
        assert q == r, (preset, gpus, nodes, memory, host, link, accelerator)
        differ += q != hook("plan", "recommend", *args)  # without a host figure
        refused += plan.cheapest(**subs(cfg)) is None
    assert differ > 10 and refused > 10, (differ, refused)  # the node's RAM changes picks and refuses plans


# Literals that only hooks/presets.jinja may hold: every other file (copier.yml, the hooks, the
# generated repo's code and docs) reads them from there, or from the presets.py rendered from it.
HOOKS = JINJA.get_template("hooks/presets.jinja").module
ONE_SOURCE = {
    "peak TFLOP/s": [rf"\b{int(v)}(\.0)?\b" for v in HOOKS.PEAK_TFLOPS.values()],
    "default backend": [r"""["']cuda["']\s*:\s*["']nccl["']"""],
    "GPUs without bf16": [r"""["']turing["'],\s*["']volta["']"""],
    "GPUs with float8": [r"""["']ada["'],\s*["']hopper["'],\s*["']blackwell["']"""],
    "link speeds": [r"""nvlink["']?\s*:\s*\d""", r"NVLink \d", r"\b150(\.0)?\b"],
    "headroom": [r"HEADROOM\s*=\s*\d"],
    "the debug run": [r"\d\)?\s+if (debug|vit) else"],  # config.jinja's debug branch reads DEBUG_RUN
}


def literal_sites(root, pattern: str) -> list[str]:
    files = [root / "copier.yml", *(root / "hooks").iterdir(), *(root / "template").rglob("*")]
    return sorted(str(f.relative_to(root)) for f in files if f.is_file() and re.search(pattern, f.read_text()))


@pytest.mark.parametrize("fact", ONE_SOURCE)
def test_each_preset_and_default_is_written_once(fact):
    # The patterns are the shapes the copies had before there was one source (each matched 2-3 files).
    for pattern in ONE_SOURCE[fact]:
        assert set(literal_sites(TEMPLATE, pattern)) <= {"hooks/presets.jinja"}, (fact, pattern)


def test_generated_python_reads_presets_and_defaults_from_the_rendered_table(plan):
    hooks = HOOKS
    presets = importlib.import_module("planpkg.presets")
    tables = (
        "LLAMA_PRESETS",
        "VIT_PRESETS",
        "MOE_PRESETS",
        "DEBUG_RUN",
        "PEAK_TFLOPS",
        "GPU_ARCHS",
        "LINK_GBPS",
        "HEADROOM",
        "DEFAULT_BACKEND",
        "LORA",
        "LLAMA3_ROPE_SCALING",
        "HOST_MEMORY",
        "EXPORT_FILE_GB",
    )
    for name in tables:
        assert getattr(presets, name) == getattr(hooks, name), name
    for kind in presets.GPU_ARCHS:
        assert presets.DEFAULT_PRECISION[kind] == hook("presets", "default_precision", "cuda", kind)
    for kind in ("xpu", "cpu"):
        assert presets.DEFAULT_PRECISION[kind] == hook("presets", "default_precision", kind, "")
    assert plan.ARCH_TFLOPS["hopper"] == presets.PEAK_TFLOPS["H100"] == 989.0  # a generation's flagship
    # The defaults of config/sections.py and of the models' hyperparameters are the debug run's, by reference:
    # none of the fields the presets set has a literal default. ViT's module is read from the template (this
    # render has none).
    from planpkg.config import CheckpointConfig, TrainConfig
    from planpkg.models.llama import LlamaConfig

    src = Path(plan.__file__).parents[1]
    vit = next((TEMPLATE / "template" / "src" / "{{package_name}}" / "models").glob("*vit*/model.py*"))
    classes = {}
    for path in (src / "config" / "sections.py", src / "models" / "llama" / "model.py", vit):
        classes |= {node.name: node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    preset_fields = {
        "BlockConfig": set(hooks.LLAMA_PRESETS["debug"]),
        "LlamaConfig": set(hooks.LLAMA_PRESETS["debug"]),
        "ViTConfig": set(hooks.VIT_PRESETS["vit-debug"]),
        "TrainConfig": {"steps", "global_batch_size", "micro_batch_size", "seq_len", "lr", "warmup_steps"},
        "CheckpointConfig": {"interval"},
    }
    checked = 0
    for cls, names in preset_fields.items():
        for node in classes[cls].body:
            if isinstance(node, ast.AnnAssign) and node.target.id in names:
                assert not isinstance(node.value, ast.Constant), f"{cls}.{node.target.id} copies a preset's value"
                checked += 1
    assert checked == 26  # the blocks' 5, the decoder's 5, the ViT's 9, training's 6, checkpoints' 1
    run = hooks.DEBUG_RUN
    assert LlamaConfig().dim == hooks.LLAMA_PRESETS["debug"]["dim"]
    train = TrainConfig()
    assert (train.steps, train.lr, CheckpointConfig().interval) == (run["steps"], run["lr"], run["checkpoint_interval"])


def test_gpu_generations_agree_with_the_question_and_the_probe():
    # hwprobe.py runs before copier, with nothing but Python, so it keeps its own list of the generations.
    probe = (TEMPLATE / "hwprobe.py").read_text()
    archs = ast.literal_eval(re.search(r"^ARCHS = (\(.*\))$", probe, re.M).group(1))
    choices = yaml.safe_load((TEMPLATE / "copier.yml").read_text())["gpu_arch"]["choices"]
    assert list(choices.values()) == list(HOOKS.GPU_ARCHS) == list(archs)
    for label, arch in choices.items():
        assert f"sm {HOOKS.GPU_ARCHS[arch]['sm']}" in label, label


# Issue 42's long-context goals on H100 80 GiB nodes: the answers, and the plan the render must take (context-parallel
# degree, activation checkpointing, sharding, CPU offload, activation offload) with its peak per GPU in GiB.
LONG_CONTEXT = {
    "8b-1048576-one-node": ({"model_size": "8b", "seq_len": 1048576}, (8, "full", "shard_grad_op", False, True), 60.3),
    "8b-262144-one-node": ({"model_size": "8b", "seq_len": 262144}, (4, "full", "shard_grad_op", False, False), 60.1),
    "70b-131072-8-nodes": ({"model_size": "70b", "num_nodes": 8, "inter_node_link": "infiniband", "seq_len": 131072},
                           (8, "full", "full", False, False), 54.7),
    "1b-131072-one-gpu": ({"model_size": "1b", "gpus_per_node": 1, "seq_len": 131072},
                          (1, "full", "no_shard", False, False), 64.6),
}  # fmt: skip


@pytest.mark.parametrize("goal", LONG_CONTEXT)
def test_long_context_goals_render_within_device_and_host_memory(plan, tmp_path, goal):
    from planpkg.config import load_config

    answers, (cp, ac, sharding, cpu_offload, parked), peak = LONG_CONTEXT[goal]
    root = render(tmp_path / "p", answers)
    preset = answers["model_size"]
    cfg = load_config(["--config", str(root / "configs" / f"{preset}.toml")])
    p = cfg.parallel
    chosen = (p.context_parallel, p.activation_checkpointing, p.sharding, p.cpu_offload, p.activation_offload)
    assert chosen == (cp, ac, sharding, cpu_offload, parked)
    # Run time plans the config as question time did: the same degree, the same choice, within both budgets.
    assert plan.recommend_context_parallel(**subs(cfg)) == cp
    assert plan.cheapest(**subs(cfg)) == plan.PlanChoice(ac, sharding, cpu_offload, parked)
    m = plan.plan_for(**{k: v for k, v in subs(cfg).items() if k != "checkpoint"})
    assert round(m.total / GIB, 1) == peak and m.total <= HOOKS.HEADROOM * 80 * GIB
    host = plan.host_plan_for(**subs(cfg), m=m)
    assert host.total <= HOOKS.HOST_MEMORY["headroom"] * cfg.hardware.host_memory_gb * GIB
    said = (root / "PLAN.md").read_text()
    assert f"needs **{peak} GiB** per GPU" in said and f"**{host.total / GIB:.1f} GiB** of host memory per node" in said
    # Past the preset's 131,072 positions the config extends the context with YaRN over them (PLAN.md says so).
    if answers["seq_len"] > PRESETS[preset]["max_seq_len"]:
        r = cfg.model.rope_scaling
        assert cfg.model.max_seq_len == answers["seq_len"] == r.factor * r.original_max_position_embeddings
        assert (r.rope_type, r.original_max_position_embeddings) == ("yarn", PRESETS[preset]["max_seq_len"])
        assert f"## Context extension: 131072 to {answers['seq_len']} tokens, yarn" in said
    else:
        assert cfg.model.max_seq_len == PRESETS[preset]["max_seq_len"] and cfg.model.rope_scaling.rope_type == "llama3"
