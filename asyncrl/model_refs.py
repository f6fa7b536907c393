"""`model:NAME` in a run config: the prepared folder of a known model (asyncrl.model.model_dir).

`asyncrl up` resolves these before it writes the children's configs, so the processes only ever
see plain paths: `init_checkpoint = "model:smollm2"` -> the HF folder, `tokenizer = "model:smollm2"`
-> the folder (its tokenizer.json), a worker's `model = "model:smollm2"` (vLLM) -> the folder.
Nested tables (the trainer's [trainer.policy], the worker's [worker.engine]) are resolved too."""

from __future__ import annotations

from asyncrl.model import is_prepared, model_dir

PREFIX = "model:"
KEYS = {"init_checkpoint": "", "model": "", "tokenizer": ""}


def resolve(conf: dict) -> dict:
    """A copy of one process's config with every `model:NAME` value of KEYS made a path."""
    out = {k: resolve(v) if isinstance(v, dict) else v for k, v in conf.items()}
    for key, leaf in KEYS.items():
        v = out.get(key)
        if isinstance(v, str) and v.startswith(PREFIX):
            name = v[len(PREFIX) :]
            if not is_prepared(name):
                raise ValueError(
                    f"{key} = {v!r}: model {name!r} is not prepared in the model cache "
                    f"{model_dir(name).parent.parent}; run `make models` or `asyncrl model prepare {name}`"
                )
            out[key] = str(model_dir(name) / leaf) if leaf else str(model_dir(name))
    return out
