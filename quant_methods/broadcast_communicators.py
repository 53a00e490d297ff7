"""The communicators of the broadcast road (:mod:`foursight.quant_methods.weight_broadcast`): how a rank
joins the trainer's group and broadcasts over it.

The communicator is the only part of the road that depends on the transport (:class:`Communicator`:
``broadcast(tensor, src)``, ``close()``), so it lives apart from the messages, the wire format and the
receiver: :class:`NcclCommunicator` is vLLM's ``PyNcclCommunicator`` (CUDA), :class:`GlooCommunicator` is
torch's Gloo process group over the same store (CPU; what the tests run). :func:`open_communicator` joins
the group at the trainer's store (vLLM's ``StatelessProcessGroup``) and builds the one asked for.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch

#: the communicators a group can use: NCCL (CUDA) and Gloo (CPU; the tests' stand-in)
COMMUNICATORS = ("nccl", "gloo")


class Communicator(Protocol):
    """What the road needs of a group: a broadcast from ``src`` into ``tensor`` (in place on the
    receivers), and a close. Ranks: the trainer is 0, the engine's workers follow."""

    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def close(self) -> None: ...


class NcclCommunicator:
    """vLLM's ``PyNcclCommunicator`` on the group's store (the communicator of vLLM's ``nccl`` backend and
    of TRL's client), broadcasting on the current CUDA stream. CUDA only; not run on the CPU machine."""

    def __init__(self, group: Any, device: torch.device | int):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        try:  # vLLM 0.32: NCCL must not inherit the engine's pinned NCCL settings
            from vllm.utils.nccl import unpinned_nccl_env
        except ImportError:
            self.comm = PyNcclCommunicator(group, device=device)
        else:
            with unpinned_nccl_env():
                self.comm = PyNcclCommunicator(group, device=device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream())

    def close(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if callable(destroy):
            destroy()


class GlooCommunicator:
    """torch's Gloo process group on the group's store (a prefix of its own), outside torch's global group:
    the CPU stand-in for NCCL. Tensors travel as their bytes (Gloo has no bfloat16 on every build)."""

    def __init__(self, group: Any, timeout_s: float = 300.0):
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self._pg = ProcessGroupGloo(PrefixStore("foursight-gloo/", group.store), group.rank, group.world_size,
                                    timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        from torch.distributed import BroadcastOptions

        if not tensor.is_contiguous():
            raise ValueError("gloo broadcast: the tensor must be contiguous (it travels as its bytes)")
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._pg.broadcast([tensor.view(-1).view(torch.uint8)], opts).wait()

    def close(self) -> None:
        self._pg = None


def open_communicator(kind: str, master_address: str, master_port: int, rank: int, world_size: int,
                      device: torch.device | int | None = None, timeout_s: float = 300.0) -> Communicator:
    """Join the group at ``master_address:master_port`` as ``rank`` of ``world_size`` (rank 0 hosts the
    store: the trainer) through vLLM's ``StatelessProcessGroup`` (outside torch's global group, as vLLM's
    ``nccl`` backend does), then build the ``kind`` communicator on it. Blocks until every rank joined."""
    from vllm.distributed.utils import StatelessProcessGroup

    if kind not in COMMUNICATORS:
        raise ValueError(f"communicator must be one of {', '.join(COMMUNICATORS)}, got {kind!r}")
    group = StatelessProcessGroup.create(host=master_address, port=int(master_port), rank=rank, world_size=world_size,
                                         store_timeout=int(timeout_s))
    if kind == "nccl":
        return NcclCommunicator(group, device if device is not None else torch.cuda.current_device())
    return GlooCommunicator(group, timeout_s)
