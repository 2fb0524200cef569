"""Answer sets for the render matrix: every choice of every question appears at least once.

Each set starts from copier's defaults (8 x H100 80 GB, Llama 8B), so a set names only what it
changes; the planner fills in the rest the way it would for a user.
"""

MATRIX = {
    # The ViT presets, planned for their hardware (render checks only).
    "vit_base": {"model_type": "vit"},
    "vit_large_ampere": {"model_type": "vit", "model_size": "vit-large", "gpu_arch": "ampere", "gpus_per_node": 4},
    "vit_huge_blackwell": {"model_type": "vit", "model_size": "vit-huge", "gpu_arch": "blackwell", "float8": "rowwise"},
    # cuda/hopper/nvlink, 8b, bf16, selective AC + shard_grad_op (the planner's pick), compile, nccl, env
    "default": {},
    # The laptop: CPU ranks with gloo, fp32, full sharding, no AC.
    "cpu_debug": {"accelerator": "cpu", "model_size": "debug"},
    # Two Ampere nodes on Ethernet: hybrid sharding, tcp rendezvous, async checkpoints, every launcher; fp32
    # (the planner then checkpoints every block), as FULL below explains.
    "ampere_two_nodes_ethernet": {
        "gpu_arch": "ampere",
        "num_nodes": 2,
        "inter_node_link": "ethernet",
        "model_size": "1b",
        "mixed_precision": "fp32",
        "sharding": "hybrid",
        "init_method": "tcp",
        "checkpoint_format": "dcp_async",
        "launchers": ["torchrun", "slurm", "kubernetes"],
    },
    # Volta over PCIe: your own model (the custom stub) on a token file, fp16 with loss scaling,
    # full AC, shard_grad_op, file rendezvous, no CI workflow.
    "volta_pcie_fp16": {
        "model_type": "custom",
        "data_source": "memmap",
        "checkpoint_export": "safetensors",
        "gpu_arch": "volta",
        "gpus_per_node": 4,
        "gpu_memory_gb": 32,
        "intra_node_link": "pcie",
        "model_size": "125m",
        "mixed_precision": "fp16",
        "activation_checkpointing": "full",
        "sharding": "shard_grad_op",
        "compile": False,
        "init_method": "file",
        "ci_workflow": False,
    },
    # Intel GPUs, a transformers Mistral from a local dataset, launched on Kubernetes only.
    "xpu": {
        "model_type": "hf_causal_lm",
        "hf_architecture": "mistral",
        "data_source": "hf_dataset",
        "accelerator": "xpu",
        "gpus_per_node": 4,
        "model_size": "3b",
        "backend": "xccl",
        "launchers": ["kubernetes"],
    },
    # Four Blackwell nodes on InfiniBand, Llama 70B: FSDP alone is communication-bound there, so
    # groups of four GPUs split every layer (tensor parallelism, the planner's pick too).
    "blackwell_70b": {
        "gpu_arch": "blackwell",
        "num_nodes": 4,
        "inter_node_link": "infiniband",
        "model_size": "70b",
        "tensor_parallel": 4,
    },
    # Llama 3.1 8B on its whole 131,072-token context on 8 x A100 40 GB: every sequence is split over 4 GPUs
    # (context parallelism, the planner's pick: the smallest degree that fits; on 80 GiB GPUs, its loss in
    # chunks, one GPU holds a whole sequence with CPU offload).
    "long_context_8b": {"gpu_arch": "ampere", "gpu_memory_gb": 40, "seq_len": 131072},
    # Llama 3.1 8B at 8 x its context, 1,048,576 tokens, on one node of 8 x H100 80 GB: max_seq_len raised and YaRN
    # over the preset's 131,072 positions (the rope_scaling answer's default), context parallel 8, activation offload.
    "context_extension_8b": {"model_size": "8b", "seq_len": 1048576},
    # A transformers Qwen2 of the 8B shape, fine-tuned on chats (sft): on two 48 GB GPUs it only
    # fits with CPU offload (the planner's pick).
    "ada_offload": {
        "gpu_arch": "ada",
        "gpus_per_node": 2,
        "gpu_memory_gb": 48,
        "model_size": "8b",
        "model_type": "hf_causal_lm",
        "hf_architecture": "qwen2",
        "data_source": "sft",
        "float8": "tensorwise",
    },
    # DDP over MPI on Turing (MPI lacks reduce_scatter, so only no_shard is allowed).
    "turing_mpi_ddp": {
        "gpu_arch": "turing",
        "gpus_per_node": 2,
        "gpu_memory_gb": 16,
        "model_size": "debug",
        "sharding": "no_shard",
        "backend": "mpi",
        "mixed_precision": "fp16",
    },
    # CPU ranks: DDP with the ZeRO optimizer in bf16 under autocast, compiled blocks, tcp rendezvous.
    "cpu_ddp_bf16_compile": {
        "accelerator": "cpu",
        "model_size": "debug",
        "sharding": "no_shard",
        "zero_optimizer": True,
        "mixed_precision": "bf16",
        "compile": True,
        "init_method": "tcp",
    },
    # CPU ranks as two "nodes": a ViT on an image folder, hybrid, fp16, offload, full AC, async
    # checkpoints, file rendezvous.
    "cpu_hybrid_fp16_offload": {
        "model_type": "vit",
        "model_size": "vit-debug",
        "data_source": "image_folder",
        "accelerator": "cpu",
        "gpus_per_node": 1,
        "num_nodes": 2,
        "sharding": "hybrid",
        "mixed_precision": "fp16",
        "cpu_offload": True,
        "activation_checkpointing": "full",
        "checkpoint_format": "dcp_async",
        "init_method": "file",
    },
    # LoRA fine-tuning of Llama 3.1 8B on one H100: frozen bf16 weights and adapters fit without
    # offload (full fine-tuning needs it here), so the planner picks DDP on the one GPU.
    "lora_8b_one_gpu": {"finetune": "lora", "gpus_per_node": 1},
    # LoRA on CPU ranks at debug size: configs/debug-lora.toml fine-tunes the quick start's export.
    "cpu_debug_lora": {"accelerator": "cpu", "model_size": "debug", "finetune": "lora"},
    # A mixture of experts (Qwen3-MoE): the debug MoE on CPU ranks, whose generated tests run here; Qwen3-30B-A3B
    # on 8 x H100 (the planner splits its experts over the 8: expert parallelism) and Qwen3-235B-A22B on four
    # Blackwell nodes (render checks only).
    "cpu_moe": {"accelerator": "cpu", "model_type": "qwen3_moe"},
    "moe_30b_h100": {"model_type": "qwen3_moe"},
    "moe_235b_blackwell": {
        "model_type": "qwen3_moe",
        "model_size": "235b-a22b",
        "gpu_arch": "blackwell",
        "num_nodes": 4,
    },
    # gloo on CUDA (slow but valid per the capability table).
    "cuda_gloo": {
        "gpu_arch": "ampere",
        "gpus_per_node": 2,
        "model_size": "1b",
        "backend": "gloo",
        "sharding": "shard_grad_op",
    },
}

# Renders whose generated tests run here, on CPU ranks with gloo. Together they cover every
# sharding mode (DDP with the ZeRO optimizer; the strategies table runs DDP without it too),
# precision, AC mode, offload, compile, rendezvous and checkpoint format; the
# others differ only in values a CPU run does not reach (backend names, GPU sizes), or, for
# turing_mpi_ddp, need an MPI build of PyTorch.
# SMOKE: the smoke test, the FSDP2 rules and the memory plan (about a minute each).
# (ampere_two_nodes_ethernet runs only FULL: its hybrid, tcp and async choices appear here in
# cpu_hybrid_fp16_offload and cpu_ddp_bf16_compile, and the strategies table runs hybrid llama.)
SMOKE = ["default", "cpu_debug", "volta_pcie_fp16", "ada_offload", "cpu_ddp_bf16_compile", "cpu_hybrid_fp16_offload"]
# COMPILED: the SMOKE render whose compiled smoke run (inductor on CPU, a minute or more) runs: FSDP2 with
# selective AC as a user gets it. The other renders' configs compile the same blocks; their fast tier's rule
# probe traces them with aot_eager at world size 2 (DDP with the ZeRO optimizer in cpu_ddp_bf16_compile), and
# the strategies table trains compiled blocks with inductor against the golden losses.
COMPILED = ["default"]
# FULL: everything else too: checkpoints (atomicity, damage, resharding, preemption, export),
# data, uneven inputs, error messages, observability, hardware detection. The first is the CPU render;
# the second adds what changes with hybrid sharding, tcp rendezvous and async checkpoints
# (test_generated.ONCE_TESTS are the first's alone). Both compute in fp32: nothing the full tier checks
# depends on the compute precision (checkpoints hold fp32 state under any mixed precision), and a CPU
# without bf16 instructions multiplies bf16 or fp16 matrices about 30 times slower than fp32 ones (a
# 256 x 128 by 128 x 384 matmul on one thread of the CI machine's AMD EPYC: 60 GFLOP/s in fp32, 1.8 in
# bf16, 2.3 in fp16). bf16 and fp16 run in the SMOKE renders' fast tiers.
FULL = ["cpu_debug", "ampere_two_nodes_ethernet"]
# ONCE: the render that runs the generated tests marked `once` (their subject does not change with the
# render: each sets what it tests), in both tiers; the others leave them out. It must run both tiers.
ONCE = FULL[0]
assert ONCE in SMOKE, "the render that runs the tests marked once must run the fast tier too"
# FAULTS: ranks killed at eight points under torchrun --max-restarts (needs env:// rendezvous).
FAULTS = ["cpu_debug"]
# STRATEGIES: every sharding mode at world sizes 1, 2 and 4 against one golden loss table.
STRATEGIES = ["cpu_debug"]
# FLOAT8: float8 training of a tiny model on CPU ranks (emulated matmuls; about a minute), which
# the FULL renders leave out. Every render has the code; the conversion tests run in-process.
FLOAT8 = ["cpu_debug"]
# SFT: chats prepared with a tokenizer built in the test, the loss masked to the replies, 2 ranks
# against one process (about a minute), which the FULL renders leave out. Every decoder render
# has the code and the test file; this one is a transformers model fine-tuned on chats.
SFT = ["ada_offload"]
# LORA: LoRA fine-tuning from a Hugging Face directory (tests/test_lora.py, five 8-step launches and
# the README's two debug runs), which the FULL renders leave out. Every llama and hf_causal_lm render
# has the code and the test (with --finetune.method lora on its debug config); cpu_debug_lora renders
# the answer itself, so the README commands it runs are a LoRA render's (configs/debug-lora.toml).
LORA = ["cpu_debug_lora"]
# PRETRAINED: transformers' Llama 3.1 and 3.2 (published configs, tiny widths) read through
# checkpoint.init_from at world size 2 (tests/test_pretrained.py, two launches), which the FULL
# renders leave out; a transformers render, so its own config check (hf_causal_lm) runs too.
PRETRAINED = ["ada_offload"]
# TENSOR_PARALLEL: FSDP x tensor parallelism on 4 CPU ranks (2 x 2) against the golden losses, its
# checkpoints resharded and its export, which the FULL renders leave out (tests/test_tensor_parallel.py;
# every render has it, and the preset configs of renders such as blackwell_70b set the degree).
TENSOR_PARALLEL = ["cpu_debug"]
# CONTEXT_PARALLEL: sequences split over 2 CPU ranks (Ulysses attention) at world size 2, 2 x FSDP 2 and
# 2 x tensor parallel 2 against one rank's losses and gradient norms, with a loss mask, a CP 2 checkpoint
# loaded and resumed on one rank and at world size 4, its export, and a refused launch, which the FULL
# renders leave out (tests/test_context_parallel.py; every render has it, the llama ones run it).
CONTEXT_PARALLEL = ["cpu_debug"]
# HOST_MEMORY: the host-memory plan against resident memory on 2 CPU ranks of a wider model (tests/test_plan.py's
# host_memory test, one launch), which the other SMOKE renders leave out: it forces its own model, sharding,
# offload and checkpoint settings, so one render shows what every render would.
HOST_MEMORY = ["cpu_debug"]
# TRANSFORMERS_TENSOR_PARALLEL: the same file in a transformers render (hf_causal_lm, qwen2), whose plan is
# transformers' own, without sequence parallelism: the plan read and refused, the 2 x 2 run against the
# golden losses, its checkpoint loaded on one rank and its export (two launches). The reshards, the eager
# pair and the refused launch exercise what the built-in model's run above already does.
TRANSFORMERS_TENSOR_PARALLEL = ["ada_offload"]
# MOE: the mixture of experts' generated suite (tests/test_expert_parallel.py and test_moe_model.py, marker
# moe: expert parallelism 2 and 2 x FSDP 2 against one rank, checkpoints across degrees, transformers' weights
# in and out, the plan's MoE terms against what the ranks hold), with that render's fast tier (the smoke test
# and the FSDP2 rules, on the debug MoE). About three minutes on two cores.
MOE = ["cpu_moe"]
# GENERATE: `python -m <pkg>.generate` from a checkpoint trained at world size 2 and from its export, and its
# refusals (tests/test_generate.py's launches and subprocesses), which the FULL renders leave out. Every llama
# and hf_causal_lm render has the file, whose fast tests (greedy tokens against transformers' generate, the
# built-in llama's Llama 3.1 rotary scaling included) run in the fast tier; a transformers render runs both models.
GENERATE = ["ada_offload"]
# HF_CONFIG: a transformers Mistral built from a bf16 config.json (model.hf_config) trained in fp32 under FSDP and
# under tensor parallelism (tests/test_hf_config.py, two launches), in the one render whose model is hf_causal_lm
# among the SMOKE renders (its refusals run in its fast tier).
HF_CONFIG = ["ada_offload"]
