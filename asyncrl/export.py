"""`asyncrl export RUN_DIR [--version N] OUT`: one policy version of a run as a standard HF folder.

    OUT/config.json + model.safetensors (bf16, Llama or Qwen2 layout)   loads with transformers
    OUT/tokenizer*.json ...        copied when the run's trainer used a tokenizer.json / HF folder
    OUT/README.txt                 where the weights came from; for the char tokenizer, how to decode

Source, in this order:
  1. a trainer checkpoint holding version N (runs/<id>/checkpoints/ckpt-e*-v*.pt; a trainer
     group's names its folder of DCP shards, read whole here): its fp32 weights cast to bf16 must
     match the digest recorded for the published weights;
  2. otherwise the run's own NATS store (runs/<id>/nats): the newest keyframe at or below N,
     then the deltas up to N, each checked (signature with --public-key, base and result
     digests). If retention dropped a delta or keyframe needed, it says so and writes nothing.
Without --version: the newest checkpoint's version.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from pathlib import Path

import click
import torch

import delta_codec
from delta_codec import signing
from kernel.cli import Command, run
from policy import ModelConfig, Transformer, save_hf_checkpoint
from policy.model import inference_state
from trainer.shards import load_model_state

CKPT = re.compile(r"^ckpt-e(\d{8})-v(\d{8})\.pt$")
# the files an HF tokenizer folder is made of (weights and model config are ours to write)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)


class ExportError(RuntimeError):
    pass


def checkpoints(run_dir: Path) -> list[tuple[int, int, Path]]:
    """(epoch, version, path) of every checkpoint file, oldest first."""
    d = run_dir / "checkpoints"
    found = [
        (int(m[1]), int(m[2]), p) for p in (d.iterdir() if d.is_dir() else ()) if (m := CKPT.match(p.name))
    ]
    return sorted(found)


def _model(model_config: dict) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(model_config))
    model = model.to_empty(device="cpu")
    model.reset_rope()  # built on meta: the RoPE tables must be computed for real
    return model.eval()


def from_checkpoint(path: Path) -> tuple[dict, dict, str]:
    """-> (bf16 state, model_config, digest) after checking the recorded digest."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: never runs code
    except Exception as e:
        raise ExportError(f"checkpoint {path} is unreadable: {e}") from e
    missing = [k for k in ("version", "model", "model_config", "digest") if k not in raw]
    if missing:
        raise ExportError(f"checkpoint {path} lacks {missing}")
    model = _model(raw["model_config"])
    try:  # a trainer group's checkpoint names its DCP shard folder: every rank's shards are read
        load_model_state(model, path.parent, raw["model"])
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        raise ExportError(f"checkpoint {path}: its weights do not load: {e}") from e
    bits = inference_state(model, dtype=torch.bfloat16)
    got = delta_codec.state_digest(bits)
    if not raw["digest"]:
        raise ExportError(f"checkpoint {path} has no recorded digest: cannot verify it")
    if got != raw["digest"]:
        raise ExportError(f"checkpoint {path}: bf16 weights digest {got} != recorded {raw['digest']}")
    return bits, raw["model_config"], got


async def replay(store_dir: Path, version: int, public_key=None) -> tuple[dict, dict, str]:
    """Rebuild version `version` from the WEIGHTS stream of a stopped run's store."""
    from nats.js.errors import NotFoundError

    from asyncrl.nats_server import EmbeddedServer
    from bus import BusConfig, connect, events
    from bus import topology as topo
    from bus.weights.rules import WEIGHTS_SUBJECTS

    if not (store_dir / "jetstream").is_dir():
        raise ExportError(
            f"no JetStream store at {store_dir}: no checkpoint holds v{version} and nothing to replay"
        )
    server = EmbeddedServer(store_dir=str(store_dir))
    await asyncio.to_thread(server.start_sync)
    bus = await connect(BusConfig(servers=[server.url], name="asyncrl-export"))
    try:
        try:
            info = await bus.js.stream_info(topo.WEIGHTS)
        except NotFoundError:
            raise ExportError(f"{store_dir} holds no {topo.WEIGHTS} stream") from None
        msgs, seq = [], info.state.first_seq - 1
        while True:  # the whole (retained) stream, in order: it is small, deltas are sparse
            try:
                raw = await bus.js.get_msg(topo.WEIGHTS, seq=seq + 1, subject=WEIGHTS_SUBJECTS, next=True)
            except NotFoundError:
                break
            seq = raw.seq
            msgs.append((raw.seq, events.decode(raw.data)))

        async def payload(ev) -> bytes:
            data = ev.payload if ev.payload is not None else await bus.get_blob(ev.blob)
            if len(data) != ev.size:
                raise ExportError(f"{ev.msg_id()}: {len(data)} bytes, announced {ev.size}")
            if public_key is not None:
                if not ev.signature:
                    raise ExportError(f"{ev.msg_id()} is unsigned, a public key was given")
                signing.verify(public_key, data, ev.signature)  # DeltaError names the failure
            return data

        kfs = [
            (i, ev)
            for i, (_, ev) in enumerate(msgs)
            if isinstance(ev, events.KeyframeEvent) and ev.version <= version
        ]
        if not kfs:
            have = sorted({ev.version for _, ev in msgs if isinstance(ev, events.KeyframeEvent)})
            raise ExportError(
                f"no keyframe at or below v{version} is retained in {store_dir} "
                f"(keyframes held: {have or 'none'}); retention dropped what v{version} needs"
            )
        start, kev = kfs[-1]  # the newest in stream order: a takeover's line wins over the deposed one
        kf = delta_codec.Keyframe.from_bytes(await payload(kev))
        if kf.version != kev.version or (kev.digest and kf.digest != kev.digest):
            raise ExportError(f"keyframe v{kev.version}: payload does not match its event")
        state = delta_codec.load_keyframe(kf)
        cur, digest = kf.version, kf.digest
        for _, ev in msgs[start + 1 :]:
            if cur == version:
                break
            if not isinstance(ev, events.DeltaEvent) or ev.epoch < kev.epoch or ev.to_version <= cur:
                continue
            if ev.from_version != cur:
                raise ExportError(
                    f"delta v{cur}->v{cur + 1} is not retained in {store_dir} (next held: "
                    f"v{ev.from_version}->v{ev.to_version}); retention dropped what v{version} needs"
                )
            d = delta_codec.Delta.from_bytes(await payload(ev))
            if (d.base_digest, d.new_digest) != (ev.base_digest, ev.new_digest):
                raise ExportError(f"{ev.msg_id()}: payload digests differ from the announced ones")
            delta_codec.apply_delta(state, d)  # checks the result's state digest (names a wrong base)
            cur, digest = d.to_version, d.new_digest
        if cur != version:
            raise ExportError(f"the retained deltas end at v{cur}, v{version} was asked for")
        if delta_codec.state_digest(state) != digest:
            raise ExportError(
                f"replayed v{version}: digest {delta_codec.state_digest(state)} != published {digest}"
            )
        return state, kev.model_config, digest
    finally:
        await bus.close()
        await asyncio.to_thread(server.stop_sync)


def _tokenizer(run_dir: Path) -> str:
    p = run_dir / "config" / "run.json"
    if not p.is_file():
        return "char"
    trainer = json.loads(p.read_text()).get("trainer", {})
    # [trainer.policy] tokenizer; a run made before the trainer's config had sections: at the top
    return str(trainer.get("policy", {}).get("tokenizer") or trainer.get("tokenizer", "char"))


def write_export(run_dir, out, version: int | None = None, public_key=None) -> dict:
    """Writes OUT; returns what was exported (version, source, digest)."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} is not a run directory")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty")
    ckpts = checkpoints(run_dir)
    if version is None:
        if not ckpts:
            raise ExportError(
                f"{run_dir} has no checkpoint: give --version N to replay it from the NATS store"
            )
        version = max(v for _, v, _ in ckpts)
    held = [p for _, v, p in ckpts if v == version]
    if held:
        state, model_config, digest = from_checkpoint(held[-1])  # highest epoch
        source = f"checkpoint {held[-1].name}"
    else:
        state, model_config, digest = asyncio.run(replay(run_dir / "nats", version, public_key))
        source = f"keyframe + deltas replayed from {run_dir / 'nats'}"
    model = _model(model_config)
    model.load_inference_state(state)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model, out, dtype=torch.bfloat16)
    tok = _tokenizer(run_dir)
    lines = [
        f"asyncrl export of {run_dir.resolve()} at policy version {version}",
        f"source: {source}",
        f"published bf16 weights digest: {digest}",
    ]
    if tok == "char":
        from policy import CharTokenizer

        chars = CharTokenizer.default()
        lines += [
            "tokenizer: the run used asyncrl's character tokenizer (policy.CharTokenizer.default()),",
            "which has no HF tokenizer files: encode/decode with policy.load_tokenizer('char');",
            f"its vocabulary has {chars.vocab_size} ids.",
        ]
    else:
        src = Path(tok)
        files = [src] if src.is_file() else [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
        if not files:
            raise ExportError(f"the run's tokenizer {tok!r} is not readable here")
        for f in files:
            shutil.copy2(f, out / f.name)
        lines.append(f"tokenizer: copied from {tok}")
    (out / "README.txt").write_text("\n".join(lines) + "\n")
    return {"version": version, "source": source, "digest": digest, "out": str(out)}


@click.command("export", cls=Command, help=__doc__)
@click.argument("run_dir")
@click.argument("out")
@click.option("--version", type=int, default=None)
@click.option(
    "--public-key",
    default=None,
    help="verify the replayed updates' signatures (hex or a file, like [worker.weights] public_key)",
)
def cli(run_dir: str, out: str, version: int | None, public_key: str | None) -> int:
    pk = None
    if public_key:
        p = Path(public_key)
        pk = signing.public_key(p.read_text().strip() if p.is_file() else public_key)
    try:
        res = write_export(run_dir, out, version, pk)
    except (
        ExportError,
        delta_codec.DeltaError,
        ValueError,
    ) as e:  # ValueError: e.g. an MLA model (no HF layout)
        print(f"asyncrl export: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl export")


if __name__ == "__main__":
    sys.exit(main())
