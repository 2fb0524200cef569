"""Multi-rank tests without torchrun: gloo ranks forked from the test process, which has imported torch once.

A torchrun launch pays torch's import in its agent and again in every rank, about 4 s a process
on a small CPU, before the first line of the test runs. Forked from the pytest process, which has
imported torch, torch._dynamo and this repo already (conftest.py), a rank starts in milliseconds:
the way torch's own MultiProcessTestCase runs its distributed tests. `run_ranks(n, fn, *args)`
runs `fn` on n ranks with the environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and a fresh MASTER_PORT) and returns what each returned. launch.py's
`launch` runs the trainer's own main() this way, unless a test is about torchrun itself (the smoke
run, restarts, signals, the launch scripts and their refusals), which keep launching it.

Each rank writes its output to a file (returned with the results), runs one thread (as launched
ranks do: OMP_NUM_THREADS=1), and leaves with os._exit: a forked copy of pytest must never return
into pytest. Ranks are forked only from a process that runs no other Python thread: a fork copies
the locks other threads hold but not the threads, so a rank that needs one of them waits forever
(now and then: only when the fork lands while it is held). conftest.py fails a test that leaves a
thread running. An exception or a non-zero exit in one rank stops the others, which would otherwise
wait for it in a collective, and fails the call with what that rank printed.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

_PORTS: set[int] = set()


def free_port() -> int:
    """A free TCP port on this host, never one handed out before in this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def other_threads(wait: float = 0.0, known: Collection[str] = ()) -> list[str]:
    """The names of the Python threads running in this process besides the calling one and those named in
    `known`, after giving them up to `wait` seconds to end (a Loader dropped, not closed, stops its thread
    once it is collected)."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t.name not in known]
    if others and wait:
        gc.collect()
        deadline = time.monotonic() + wait
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in others if t.is_alive()]


def ended_by(code: int) -> str:
    """How a process with exit code `code` (os.waitstatus_to_exitcode's) ended, in words."""
    if code >= 0:
        return f"exited with code {code}"
    name = signal.Signals(-code).name
    if -code == signal.SIGKILL:  # nothing in the test sends it before a rank has failed: the kernel did
        return f"was killed by {name}, from outside the test: most often the kernel's out-of-memory killer"
    return f"was killed by {name}"


@dataclass
class Ranks:
    """Forked ranks of one call, started; `wait` collects them."""

    pids: list[int]
    results: list[Connection]
    logs: list[Path]
    returned: dict[int, object] = field(default_factory=dict)
    codes: dict[int, int] = field(default_factory=dict)

    def wait(self, timeout: float = 600, *, stop_on_failure: bool = True) -> tuple[list[int], str]:
        """Exit codes per rank and everything the ranks printed, once every rank has ended. Unless every rank
        returned, the output ends with what ended the call: the first rank that failed and how, or the timeout."""
        deadline = time.monotonic() + timeout
        open_results = {conn: rank for rank, conn in enumerate(self.results)}
        note = ""
        while len(self.codes) < len(self.pids):
            for conn in wait(list(open_results), timeout=0.05):
                rank = open_results.pop(conn)
                try:
                    self.returned[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # the rank died before it could answer
                    pass
            for rank, pid in enumerate(self.pids):
                if rank not in self.codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        self.codes[rank] = os.waitstatus_to_exitcode(status)
            failed = [rank for rank, code in self.codes.items() if code != 0]
            if stop_on_failure and failed:
                note = f"\nrank {failed[0]} {ended_by(self.codes[failed[0]])}; the harness stopped {self._kill()}"
            elif time.monotonic() > deadline:
                self._dump_stacks()
                note = (
                    f"\nranks timed out after {timeout:.0f} s (above, where each rank's threads were); the "
                    f"harness stopped {self._kill()}"
                )
        return [self.codes[rank] for rank in range(len(self.pids))], self.output() + note

    def _dump_stacks(self) -> None:
        """Have each rank still running write its threads' Python stacks to its log, so that a hang says which
        collective or lock it waits on (_rank registered SIGUSR2 for it: the trainer takes SIGUSR1 as preemption)."""
        for rank, pid in enumerate(self.pids):
            if rank not in self.codes:
                os.kill(pid, signal.SIGUSR2)
        time.sleep(2)

    def _kill(self) -> str:
        """SIGKILL every rank still running; which ranks those were, for the output."""
        stopped = [rank for rank in range(len(self.pids)) if rank not in self.codes]
        for rank in stopped:
            os.kill(self.pids[rank], signal.SIGKILL)
            self.codes[rank] = os.waitstatus_to_exitcode(os.waitpid(self.pids[rank], 0)[1])
        return f"ranks {stopped} with SIGKILL" if stopped else "no other rank"

    def output(self) -> str:
        return "\n".join(log.read_text() for log in self.logs if log.exists())


def start_ranks(
    world_size: int, fn: Callable, *args, log_dir: Path, local_world_size: int | None = None,
    env: dict[str, str] | None = None,
) -> Ranks:  # fmt: skip
    """Fork `world_size` ranks that each run fn(*args) (see the module docstring); `wait()` on the result."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("forked ranks cannot use CUDA once this process has: run GPU tests under torchrun")
    if others := other_threads(wait=2):
        raise RuntimeError(
            f"cannot fork ranks while other threads run in this process ({others}): a rank would "
            "inherit the locks they hold, without them; stop them (Loader.close(), Run.release())"
        )
    log_dir.mkdir(parents=True, exist_ok=True)
    port, local = free_port(), local_world_size or world_size
    pids, results, logs = [], [], []
    for rank in range(world_size):
        log = log_dir / f"rank{rank}-{port}.log"
        reader, writer = multiprocessing.Pipe(duplex=False)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            reader.close()
            rendezvous = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank % local,
                          "LOCAL_WORLD_SIZE": local, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
            _rank(fn, args, {**(env or {}), **{k: str(v) for k, v in rendezvous.items()}}, log, writer)
        writer.close()
        pids.append(pid)
        results.append(reader)
        logs.append(log)
    return Ranks(pids, results, logs)


def run_ranks(world_size: int, fn: Callable, *args, log_dir: Path, timeout: float = 600, **options) -> list:
    """fn(*args) on `world_size` forked ranks; what each rank returned, in rank order (AssertionError with
    the ranks' output if one failed)."""
    ranks = start_ranks(world_size, fn, *args, log_dir=log_dir, **options)
    codes, output = ranks.wait(timeout)
    if any(codes) or len(ranks.returned) < world_size:
        name = getattr(fn, "__name__", fn)
        raise AssertionError(f"{name} on {world_size} ranks: exit codes {codes}\n{output[-12000:]}")
    return [ranks.returned[rank] for rank in range(world_size)]


def _rank(fn: Callable, args: tuple, env: dict[str, str], log: Path, result: Connection) -> None:
    """The body of a forked rank: its environment and output, fn, its answer, and os._exit."""
    code, value = 1, None
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        # pytest's capture objects write elsewhere: the rank's own streams go to its log.
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - kept open until os._exit
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)  # Ranks.wait, on a timeout
        os.environ.update(env)
        torch.set_num_threads(1)
        value, code = fn(*args), 0
        if dist.is_initialized():  # fn left the group up (a probe): every rank is done with it
            dist.barrier()
    except SystemExit as exit_:  # main()'s refusal: local rank 0 exits 2, the others 0
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported through the log and the exit code
        traceback.print_exc()
    finally:
        try:
            result.send_bytes(pickle.dumps(value))
        except Exception:  # noqa: BLE001 - an unpicklable value: the call fails on the missing answer
            traceback.print_exc()
            code = code or 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
