"""The bus's own exceptions (one module, so client, blobs and regions import them without a cycle)."""


class KVConflict(Exception):
    """kv_create on an existing key, or kv_update with a stale revision (lost the race)."""


class ConnectError(Exception):
    """No server reachable at startup, or the server refused our credentials."""


class PublishError(Exception):
    """A publish that JetStream did not acknowledge (no stream for the subject, server away)."""


class BlobError(Exception):
    """A blob that is missing or whose bytes do not match the digest recorded at put time."""


class EventError(ValueError):
    """A body that is not a valid event: malformed msgpack, wrong schema, missing/wrong fields,
    a number out of its range. Bad input: consumers park it in DLQ at once, never retry it."""
