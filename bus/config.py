"""The bus's own configuration: servers, credentials, TLS, timeouts and the topology (BusConfig),
and the URL helpers that keep credentials out of logs. Loaded by kernel.config like every section."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from bus.topology import TopologyConfig
from kernel.config import ConfigError, CsvList, Maybe, config_class

# a domain is a subject token ($JS.<domain>.API.>): no dots, wildcards or spaces
Domain = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]+$")]


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


@config_class
class BusConfig:
    servers: CsvList[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    name: Annotated[str, Field(description="client name shown by the server; also the Rl-From header")] = (
        "asyncrl"
    )
    user: Maybe[str] = None
    password: Maybe[str] = None
    token: Maybe[str] = None
    nkeys_seed: Annotated[Maybe[str], Field(description="path to an nkey seed file")] = None
    creds: Annotated[Maybe[str], Field(description="path to a .creds file (JWT + seed)")] = None
    # TLS (servers "tls://host:4222"; deploy/nats/single-tls.conf)
    tls_ca: Annotated[Maybe[str], Field(description="the CA that signed the server's certificate")] = None
    tls_cert: Annotated[
        Maybe[str], Field(description="this client's certificate (the server verifies it: verify: true)")
    ] = None
    tls_key: Annotated[Maybe[str], Field(description="this client's certificate's key (needs tls_cert)")] = (
        None
    )
    tls_hostname: Maybe[str] = None
    connect_timeout_s: float = 5.0
    connect_attempts: Annotated[
        int, Field(description="initial connect (tenacity); afterwards reconnects are forever")
    ] = 30
    reconnect_wait_s: Annotated[
        float, Field(description="between reconnect attempts to one server (forever, never gives up)")
    ] = 0.5
    reconnect_wait_max_s: Annotated[
        float, Field(description="cap of the backoff for the first connect and publish retries")
    ] = 5.0
    request_timeout_s: Annotated[float, Field(description="JetStream API / publish ack timeout")] = 10.0
    publish_retries: Annotated[int, Field(description="a publish is retried (safe: Nats-Msg-Id dedupes)")] = 8
    js_domain: Annotated[
        Maybe[Domain],
        Field(
            description='JetStream domain (a worker behind a leaf node reaches the hub\'s "hub")',
        ),
    ] = None
    weights_domain: Annotated[
        Maybe[Domain],
        Field(
            description="a region's JetStream domain: read WEIGHTS + blobs from its mirrors "
            "(bus.weights.regions); needs js_domain (the hub's, where tasks and rollouts live)",
        ),
    ] = None
    topology: TopologyConfig = field(default_factory=TopologyConfig)

    @model_validator(mode="after")
    def _secrets_and_tls(self):
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
        # a region's worker reads weights from its own server but work from the hub: without
        # js_domain its task pulls (and provisioning) would address the region's JetStream
        if self.weights_domain and self.weights_domain != self.js_domain and not self.js_domain:
            raise ValueError(
                f"weights_domain={self.weights_domain!r} (a region's mirrors) needs js_domain "
                f"set to the hub's domain (e.g. 'hub'), where tasks and rollouts live"
            )
        return self


PLACEHOLDER = "CHANGE-ME"


def is_placeholder(secret: str) -> bool:
    """A shipped placeholder (deploy/env: CHANGE-ME-<role>), or the older example-*-change-me ones."""
    return PLACEHOLDER.lower() in secret.lower()
