"""bus: the JetStream backbone (connection, topology, events, consumer loop, blobs, logging)."""

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
from bus.config import BusConfig, ConfigError, load_config
from bus.consumer import (
    ConsumerLoop,
    HandlerContext,
    LoopStats,
    TransientError,
    park_max_delivered,
    watch_max_deliveries,
)
from bus.events import EventError
from bus.log import get_logger, setup_logging
from bus.server import EmbeddedServer, ServerError, run_foreground
from bus.topology import TopologyConfig

__all__ = [
    "EmbeddedServer",
    "ServerError",
    "run_foreground",
    "BusConfig",
    "ConfigError",
    "load_config",
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
    "setup_logging",
    "get_logger",
    "TopologyConfig",
]
