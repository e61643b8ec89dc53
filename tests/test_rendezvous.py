"""The rendezvous of the local gloo runs (st_cached_losses.testing), in this process, without spawning: the parent's
store holds its port from the moment the port is chosen to the end of the run, so no other process can take it in
between, and a rank set up by ``local_rank_setup`` joins through it as a client."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from unittest import mock

import pytest
import torch.distributed as dist

from st_cached_losses.testing import local_rank_setup, rendezvous_store


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_the_store_holds_its_port_until_the_run_ends():
    with rendezvous_store() as port:
        with pytest.raises(OSError, match="already in use"):
            _bind(port)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        client.set("seen", "yes")
        assert client.get("seen") == b"yes"
        del client
    _bind(port)  # released with the store


def test_a_rank_joins_through_the_parents_store():
    """Rank 0 of a one-process run: torch's env:// rendezvous connects to the store (were rank 0 to host a store
    itself, as by default, binding the port the parent holds would fail)."""
    with rendezvous_store() as port, mock.patch.dict(os.environ):
        local_rank_setup(0, 1, port)
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=30))
        try:
            assert dist.get_world_size() == 1
        finally:
            dist.destroy_process_group()
