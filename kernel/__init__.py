"""kernel: what every process needs and nothing about NATS: typed config from file + env
(kernel.config), command lines (kernel.cli), structured logs (kernel.log), Prometheus metrics
(kernel.metrics) and process lifetime (kernel.lifetime). Libraries and processes depend on it; it
depends on none of ours."""

from kernel.config import ConfigError, load_config
from kernel.log import get_logger, setup_logging

__all__ = ["ConfigError", "load_config", "get_logger", "setup_logging"]
