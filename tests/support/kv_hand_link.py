"""A hand-driven rank-transport link for fault tests: an authenticated control connection of its own and,
over it, epoch 0's gloo group, as a real SenderLink opens them. Tests then speak the protocol by hand
(kv_transfer.dist.protocol / kv_transfer.control.exchange) to produce what the real sender never does."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

from kv_transfer import ReceiverAddress, TransferConfig
from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.handshake import PeerHello
from kv_transfer.dist.channel import SENDER, PairChannel
from kv_transfer.dist.sender import open_control


@contextlib.contextmanager
def hand_link(to: ReceiverAddress, config: TransferConfig, namespace: str, rank: int,
              with_group: bool = True) -> Iterator[tuple[ControlConnection, PairChannel | None]]:
    """(connection, connected gloo channel or None) to the receiver at `to`, as sender `rank`, lane 0;
    both closed on exit."""
    conn = open_control(to, config, PeerHello(namespace, rank, 0))
    channel = PairChannel("gloo", SENDER, "cpu", config.connect_timeout_s) if with_group else None
    try:
        if channel is not None:
            conn.send(Kind.CONNECT, 0, time.monotonic() + config.connect_timeout_s)
            channel.connect(conn)
        yield conn, channel
    finally:
        if channel is not None:
            channel.close()
        conn.close()
