"""The bus's own configuration: servers, credentials, TLS, timeouts and the topology (BusConfig),
and the URL helpers that keep credentials out of logs. Loaded by kernel.config like every section."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bus.topology import TopologyConfig
from kernel.config import ConfigError


def redact_url(url: str) -> str:
    """A server URL with its credentials (user:password@ or token@) shown as ***@: for logs,
    messages and files. Anything else unchanged."""
    scheme, sep, rest = url.partition("://")
    netloc = (rest if sep else url).split("/", 1)[0]
    if "@" not in netloc:
        return url
    return url.replace(netloc, "***@" + netloc.rsplit("@", 1)[1], 1)


def url_credentials(url: str) -> tuple[str, dict[str, str]]:
    """(the URL without credentials, {"user", "password"} or {"token"} it carried, URL-decoded)."""
    from urllib.parse import unquote

    scheme, sep, rest = url.partition("://")
    netloc = (rest if sep else url).split("/", 1)[0]
    if "@" not in netloc:
        return url, {}
    info, host = netloc.rsplit("@", 1)
    user, colon, password = info.partition(":")
    creds = {"user": unquote(user), "password": unquote(password)} if colon else {"token": unquote(user)}
    return url.replace(netloc, host, 1), creds


@dataclass
class BusConfig:
    servers: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    name: str = "asyncrl"  # client name shown by the server; also the Rl-From header
    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkeys_seed: str | None = None  # path to an nkey seed file
    creds: str | None = None  # path to a .creds file (JWT + seed)
    # TLS (servers "tls://host:4222"; deploy/nats/single-tls.conf): the CA that signed the server's
    # certificate, and this client's certificate + key (the server verifies them: verify: true)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    connect_timeout_s: float = 5.0
    connect_attempts: int = 30  # initial connect (tenacity); afterwards reconnects are forever
    reconnect_wait_s: float = 0.5  # between reconnect attempts to one server (forever, never gives up)
    reconnect_wait_max_s: float = 5.0  # cap of the backoff for the first connect and publish retries
    request_timeout_s: float = 10.0  # JetStream API / publish ack timeout
    publish_retries: int = 8  # a publish is retried (safe: Nats-Msg-Id dedupes)
    js_domain: str | None = None  # JetStream domain (a worker behind a leaf node reaches the hub's "hub")
    weights_domain: str | None = (
        None  # a region's JetStream domain: read WEIGHTS + blobs from its mirrors (bus.weights.regions)
    )
    topology: TopologyConfig = field(default_factory=TopologyConfig)

    def __post_init__(self):
        # deploy/env ships CHANGE-ME-* placeholders: one left in place would be a password every
        # reader of the repository knows, so no process starts with it
        for name in ("password", "token"):
            v = getattr(self, name)
            if isinstance(v, str) and is_placeholder(v):
                raise ConfigError(
                    f"bus {name} is still the placeholder {v!r} (env ASYNCRL_BUS__{name.upper()}, "
                    f"e.g. from deploy/env/*.env): run `asyncrl deploy init` or set a real secret"
                )
        if self.tls_key and not self.tls_cert:
            raise ConfigError(
                "bus tls_key is set without tls_cert (ASYNCRL_BUS__TLS_CERT): a client certificate needs both"
            )
        # a domain is a subject token ($JS.<domain>.API.>): no dots, wildcards or spaces
        for name in ("js_domain", "weights_domain"):
            v = getattr(self, name)
            if v is not None and not _DOMAIN_RE.fullmatch(v):
                raise ValueError(f"{name} must be a JetStream domain name ([A-Za-z0-9_-]+), got {v!r}")
        # a region's worker reads weights from its own server but work from the hub: without
        # js_domain its task pulls (and provisioning) would address the region's JetStream
        if self.weights_domain and self.weights_domain != self.js_domain and not self.js_domain:
            raise ValueError(
                f"weights_domain={self.weights_domain!r} (a region's mirrors) needs js_domain "
                f"set to the hub's domain (e.g. 'hub'), where tasks and rollouts live"
            )


_DOMAIN_RE = re.compile(r"[A-Za-z0-9_-]+")
PLACEHOLDER = "CHANGE-ME"


def is_placeholder(secret: str) -> bool:
    """A shipped placeholder (deploy/env: CHANGE-ME-<role>), or the older example-*-change-me ones."""
    return PLACEHOLDER.lower() in secret.lower()
