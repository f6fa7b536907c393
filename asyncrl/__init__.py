"""asyncrl: asynchronous RL for coding agents on NATS JetStream.

From Python: `asyncrl.up(config)` starts a run and returns a `Run`; `asyncrl.load_run(dir)` opens
one that exists (asyncrl/run_handle.py). Imported lazily: `import asyncrl` stays cheap."""

__all__ = ["Run", "load_run", "up"]


def __getattr__(name: str):
    if name in __all__:
        from asyncrl import run_handle

        return getattr(run_handle, name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
