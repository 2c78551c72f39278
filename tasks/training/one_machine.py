"""The rendezvous of a world on one machine: torch's static rendezvous, with the port found after.

The launcher's agent runs the world's store on a port the store binds itself,
and the ranks are given that port: no other machine has to find the store, so
none is picked in advance (and no other process can take it in between).
c10d's rendezvous does the same with ``127.0.0.1:0``, after a random pause of
up to 0.3 s that spreads many machines' first requests; a world of one machine
has nobody to spread out. Registered with torch's rendezvous registry as
:data:`BACKEND`, which the launcher names in its ``LaunchConfig``.
"""

from __future__ import annotations

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

BACKEND = "ckptflow-one-machine"
HOST = "127.0.0.1"


class OneMachine(StaticTCPRendezvous):
    """Node 0 of 1, its store on a free port of 127.0.0.1."""

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        met = super().next_rendezvous()
        assert isinstance(self._store, TCPStore)
        port = self._store.port  # the port the store bound: the ranks connect to it
        return RendezvousInfo(met.store, met.rank, met.world_size, RendezvousStoreInfo(HOST, port))


def create(params: RendezvousParameters) -> OneMachine:
    return OneMachine(HOST, 0, 0, 1, params.run_id, int(params.config.get("timeout", 900)))


rendezvous_handler_registry.register(BACKEND, create)
