"""Activation offload (parallel.activation_offload): the block inputs that activation checkpointing keeps for the
recompute wait for their backward in host memory, not on the device.

Under activation checkpointing a block keeps its input for backward, which runs the block again from it (full
keeps nothing else; selective keeps its matmul and attention outputs too). At long sequences those inputs are most
of what a step holds: Llama 3.1 8B keeps 32 blocks x 131,072 tokens x 4,096 x 2 bytes = 32 GiB of them per sequence.
`apply_activation_offload` hooks each checkpointed block so that, while torch.utils.checkpoint saves the block's
input, a pair of torch.autograd.graph.saved_tensors_hooks (torch's way to choose where saved tensors live;
save_on_cpu is another pair) copies it to pinned host memory and lets the device's copy go. Backward brings it
back before the block's recompute needs it.

On a GPU the copies run on a side stream and overlap compute. A block's input goes to the host while the block
runs. Before the next block starts, the compute stream waits for that copy, and only then is the device's copy
dropped. While a block's backward runs, the input of the block before it comes back. The copy back is allocated
on the side stream, so record_stream tells the allocator that the compute stream uses it. The last KEEP blocks
never leave the device: their backward comes first, right after the forward. The device therefore holds at
most KEEP block inputs, and the host holds the other L - KEEP (plan/memory.py plans both). On the CPU
the "host copy" is a real copy, made and dropped at the same points, so the CPU tests check what a GPU rank
holds and that the losses are exact.

Only the block's input is parked: the one saved tensor that is the tensor the block was called with. Other saved
tensors stay where autograd keeps them: the rotary table, and under torch.compile the weights. The hooks run
outside the compiled blocks (torch.compiler.disable), and the compiled block's saved tensors pass through them
all the same. A model compiled whole has no block boundary to hook, so parallelize compiles block by block when
offload is on.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .presets import ACTIVATION_OFFLOAD

KEEP = ACTIVATION_OFFLOAD["keep"]
"""Block inputs a device holds at a time: the last two blocks' never leave it, and each other block's comes back
while the block after it runs its backward. In forward, a block's input and the previous one's, whose copy to the
host may still be running."""


@dataclass(eq=False)
class Parked:
    """One block's input between its forward and its backward: the host copy, and the device copies in flight."""

    host: torch.Tensor
    device: torch.device
    original: torch.Tensor | None
    """The device's copy, until the copy to the host is done (until the next block starts)."""
    copied: torch.Event | None = None
    """The side stream's copy to the host; None where copies are synchronous (the CPU)."""
    fetched: torch.Tensor | None = None
    """The copy back to the device, once prefetched; autograd owns it once unpacked."""
    arrived: torch.Event | None = None


class BlockInputParking:
    """The hooks that park the inputs of `blocks` checkpointed blocks. The forward of block 0 starts a new pass."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self._parked: list[weakref.ref | None] = [None] * blocks
        self._entered: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._streams: dict[torch.device, torch.Stream] = {}
        self.peak_host_bytes = 0
        """The most bytes of block inputs held in host memory at once (since construction)."""
        self.peak_device_bytes = 0
        """The most bytes of parked blocks' inputs held on the device at once (copies in flight, prefetched)."""

    @property
    def parked_blocks(self) -> int:
        """Blocks whose inputs leave the device: all but the last KEEP."""
        return max(self.blocks - KEEP, 0)

    def attach(self, layers: nn.ModuleList) -> None:
        """Hook every block: its forward saves under these hooks. Not traced by torch.compile: the hooks run
        around the compiled block, whose saved tensors they see as an eager block's."""
        for i, block in enumerate(layers):
            block.register_forward_pre_hook(torch.compiler.disable(functools.partial(self._enter, i)), with_kwargs=True)
            block.register_forward_hook(torch.compiler.disable(self._exit), with_kwargs=True, always_call=True)

    def held_bytes(self) -> tuple[int, int]:
        """Bytes of block inputs held now: in host memory, and on the device for parked blocks."""
        host = device = 0
        for parked in self._live():
            host += parked.host.nbytes
            device += sum(t.nbytes for t in (parked.original, parked.fetched) if t is not None)
        return host, device

    def _live(self) -> list[Parked]:
        return [parked for ref in self._parked if ref is not None and (parked := ref()) is not None]

    def _enter(self, i: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        key = (hidden.data_ptr(), hidden.numel()) if hidden is not None else None
        hooks = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, i, key, []), functools.partial(self._unpack, i)
        )
        hooks.__enter__()
        self._entered.append(hooks)

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        self._entered.pop().__exit__(None, None, None)

    def _pack(self, i: int, key: tuple[int, int] | None, done: list, tensor: torch.Tensor) -> object:
        if done or key != (tensor.data_ptr(), tensor.numel()):
            return tensor  # not the block's input (or a second view of it): autograd keeps it as it would
        done.append(True)
        if i == 0:
            self._parked = [None] * self.blocks  # a new forward pass
        elif (before := self._get(i - 1)) is not None and before.original is not None:
            # The previous block's copy to the host has had that block's forward to run: wait for it, then let
            # the device's copy go (freed in the compute stream's order, after the wait).
            if before.copied is not None:
                self._current(before.original.device).wait_event(before.copied)
            before.original = None
        if i >= self.blocks - KEEP:
            return tensor  # its backward comes first: it stays
        parked = self._park(tensor.detach())
        self._parked[i] = weakref.ref(parked)
        self._note_peak()
        return parked

    def _unpack(self, i: int, packed: object) -> torch.Tensor:
        # Backward reached block i: bring back the input of block i - 1 while block i recomputes and backpropagates.
        if i > 0 and (before := self._get(i - 1)) is not None and before.fetched is None:
            self._fetch(before)
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.original is not None:  # never left (a backward right after this block's forward)
            return packed.original
        if packed.fetched is None:
            self._fetch(packed)
        self._note_peak()
        tensor, packed.fetched = packed.fetched, None
        if packed.arrived is not None:
            current = self._current(tensor.device)
            current.wait_event(packed.arrived)
            tensor.record_stream(current)  # allocated on the side stream, used and freed on this one
        return tensor

    def _get(self, i: int) -> Parked | None:
        ref = self._parked[i]
        return ref() if ref is not None else None

    def _park(self, tensor: torch.Tensor) -> Parked:
        side = self._side_stream(tensor.device)
        if side is None:  # the CPU, or a device without streams: a synchronous copy (on the CPU, still a copy)
            return Parked(host=tensor.to("cpu", copy=True), device=tensor.device, original=tensor)
        device_module = torch.get_device_module(tensor.device)
        side.wait_stream(self._current(tensor.device))  # the input is written on the compute stream
        with device_module.stream(side):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            copied = side.record_event()
        return Parked(host=host, device=tensor.device, original=tensor, copied=copied)

    def _fetch(self, parked: Parked) -> None:
        side = self._side_stream(parked.device)
        if side is None:
            parked.fetched = parked.host.to(parked.device, copy=True)
            return
        # After the copy to the host, in the side stream's order.
        with torch.get_device_module(parked.device).stream(side):
            parked.fetched = parked.host.to(parked.device, non_blocking=True)
            parked.arrived = side.record_event()

    def _side_stream(self, device: torch.device) -> torch.Stream | None:
        if device.type not in ("cuda", "xpu"):
            return None
        if device not in self._streams:
            self._streams[device] = torch.get_device_module(device).Stream(device)
        return self._streams[device]

    @staticmethod
    def _current(device: torch.device) -> torch.Stream:
        return torch.get_device_module(device).current_stream(device)

    def _note_peak(self) -> None:
        host, device = self.held_bytes()
        self.peak_host_bytes = max(self.peak_host_bytes, host)
        self.peak_device_bytes = max(self.peak_device_bytes, device)


def apply_activation_offload(layers: nn.ModuleList) -> BlockInputParking:
    """Park the inputs of the checkpointed `layers` in host memory between their forward and their backward
    (after apply_ac, before compile and FSDP); the parking's counters say what it holds."""
    parking = BlockInputParking(len(layers))
    parking.attach(layers)
    return parking
