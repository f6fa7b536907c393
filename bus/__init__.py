"""bus: the JetStream transport (connection, topology, events, consumer loop, blobs) and weights.

Config loading, logging, metrics and process lifetime live in `kernel`, below this package."""

from bus.client import (
    RETRYABLE,
    BlobError,
    Bus,
    ConnectError,
    KVConflict,
    PublishError,
    ResilientPull,
    connect,
)
from bus.config import BusConfig
from bus.consumer import (
    ConsumerLoop,
    HandlerContext,
    LoopStats,
    TransientError,
    park_max_delivered,
    watch_max_deliveries,
)
from bus.events import EventError
from bus.topology import TopologyConfig

__all__ = [
    "BusConfig",
    "Bus",
    "connect",
    "ConnectError",
    "PublishError",
    "ResilientPull",
    "KVConflict",
    "BlobError",
    "RETRYABLE",
    "ConsumerLoop",
    "HandlerContext",
    "LoopStats",
    "TransientError",
    "park_max_delivered",
    "watch_max_deliveries",
    "EventError",
    "TopologyConfig",
]
