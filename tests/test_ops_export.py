"""`asyncrl export`: a run's policy version as a HF folder that `transformers` loads with the
policy's logits, from a trainer checkpoint (digest-checked) or replayed from the run's NATS store
(keyframe + signed deltas); bad inputs get a clear error and no export."""

import asyncio
import json

import pytest
import torch

import delta_codec
from asyncrl.cli import main as cli_main
from asyncrl.export import ExportError, write_export
from asyncrl.nats_server import EmbeddedServer
from bus import BusConfig, connect
from bus import topology as topo
from bus.weights.publisher import WeightPublisher
from delta_codec import signing
from policy import CharTokenizer, ModelConfig, Transformer
from policy.model import inference_state
from tests.helpers.tolerance import transformers_tol
from trainer import checkpoint

transformers = pytest.importorskip("transformers")
VOCAB = CharTokenizer.default().vocab_size


def policy(seed: int) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(ModelConfig.tiny(vocab_size=VOCAB, qkv_bias=True, max_seq_len=64)).eval()
    with torch.no_grad():  # biases start at 0: make them matter
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return m


def run_dir(tmp_path):
    d = tmp_path / "run"
    (d / "config").mkdir(parents=True)
    (d / "config" / "run.json").write_text(json.dumps({"trainer": {"tokenizer": "char"}}))
    return d


def bf16_policy(state: dict, cfg: ModelConfig) -> Transformer:
    m = Transformer(cfg).eval()
    m.load_inference_state({k: v.float() for k, v in state.items()})
    return m


def assert_same_logits(out, ours: Transformer):
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    idx = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(idx)
        # why: transformers runs the same math in its own kernels and order, its RoPE angles in fp32
        tol = transformers_tol(ours.cfg, want, idx.shape[1])
        torch.testing.assert_close(ref(idx).logits.float(), want, **tol)


def test_export_from_checkpoint_loads_in_transformers(tmp_path):
    d = run_dir(tmp_path)
    m = policy(1)
    bits = inference_state(m)
    checkpoint.save(
        d / "checkpoints",
        checkpoint.TrainerState(
            version=7,
            epoch=2,
            model=m.state_dict(),
            optimizer={},
            digest=delta_codec.state_digest(bits),
            model_config=m.cfg.to_dict(),
        ),
    )
    assert cli_main(["export", str(d), str(tmp_path / "out")]) == 0  # default: newest checkpoint
    out = tmp_path / "out"
    st = json.loads((out / "config.json").read_text())
    assert st["model_type"] == "qwen2" and st["torch_dtype"] == "bfloat16"
    assert (
        "version 7" in (out / "README.txt").read_text()
        and "character tokenizer" in (out / "README.txt").read_text()
    )
    assert_same_logits(out, bf16_policy(bits, m.cfg))


def test_export_refuses_checkpoint_with_wrong_digest(tmp_path):
    d = run_dir(tmp_path)
    m = policy(1)
    checkpoint.save(
        d / "checkpoints",
        checkpoint.TrainerState(
            version=3,
            epoch=1,
            model=m.state_dict(),
            optimizer={},
            digest="0" * 16,
            model_config=m.cfg.to_dict(),
        ),
    )
    with pytest.raises(ExportError, match="digest"):
        write_export(d, tmp_path / "out", 3)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def publish_run(store, states, cfg, keyframes, sk):
    """A run's WEIGHTS history on its own store: keyframes at `keyframes`, deltas otherwise."""

    async def go():
        srv = EmbeddedServer(store_dir=str(store))
        srv.start_sync()
        try:
            bus = await connect(BusConfig(servers=[srv.url], name="t"))
            await bus.provision()
            pub = WeightPublisher(bus, epoch=1, trainer_id="t", signing_key=sk, inline_max=4096)  # blobs too
            for v, st in enumerate(states):
                if v in keyframes:
                    await pub.publish_keyframe(st, v, cfg)
                else:
                    await pub.publish_delta(
                        delta_codec.encode_delta(states[v - 1], st, from_version=v - 1, to_version=v)
                    )
            await bus.close()
        finally:
            srv.stop_sync()

    asyncio.run(go())


def drop_delta(store, to_version):
    async def go():
        from bus import events

        srv = EmbeddedServer(store_dir=str(store))
        srv.start_sync()
        try:
            bus = await connect(BusConfig(servers=[srv.url], name="t"))
            info = await bus.js.stream_info(topo.WEIGHTS)
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                ev = events.decode((await bus.js.get_msg(topo.WEIGHTS, seq)).data)
                if isinstance(ev, events.DeltaEvent) and ev.to_version == to_version:
                    await bus.js.delete_msg(topo.WEIGHTS, seq)
            await bus.close()
        finally:
            srv.stop_sync()

    asyncio.run(go())


@pytest.fixture
def replay_run(tmp_path):
    m = policy(2)
    states = [inference_state(m)]
    for v in range(1, 6):  # a few sparse steps, as training makes them
        with torch.no_grad():
            for p in m.parameters():
                mask = torch.rand(p.shape, generator=torch.Generator().manual_seed(v)) < 0.05
                p.add_(mask * 0.05)
        states.append(inference_state(m))
    sk, pk = signing.generate_keypair()
    d = run_dir(tmp_path)
    publish_run(d / "nats", states, m.cfg, keyframes={0, 3}, sk=sk)
    return d, states, m.cfg, pk


def test_export_replays_keyframe_and_deltas(tmp_path, replay_run):
    d, states, cfg, pk = replay_run
    res = write_export(d, tmp_path / "v2", 2, signing.public_key(pk))  # keyframe 0 + deltas 1, 2
    assert res["version"] == 2 and "replayed" in res["source"]
    assert res["digest"] == delta_codec.state_digest(states[2])
    assert_same_logits(tmp_path / "v2", bf16_policy(states[2], cfg))
    res = write_export(d, tmp_path / "v5", 5, signing.public_key(pk))  # keyframe 3 + deltas 4, 5
    assert res["digest"] == delta_codec.state_digest(states[5])


def test_export_replay_wrong_key_and_missing_delta(tmp_path, replay_run):
    d, states, cfg, pk = replay_run
    _, other = signing.generate_keypair()
    with pytest.raises(delta_codec.DeltaError, match="signature"):
        write_export(d, tmp_path / "a", 2, signing.public_key(other))
    with pytest.raises(ExportError, match="v6"):  # never published
        write_export(d, tmp_path / "b", 6)
    drop_delta(d / "nats", 1)  # as retention would
    with pytest.raises(ExportError, match="retention dropped"):
        write_export(d, tmp_path / "c", 2)
    assert write_export(d, tmp_path / "d", 4)["digest"] == delta_codec.state_digest(
        states[4]
    )  # keyframe 3 still holds
    for o in ("a", "b", "c"):
        assert not (tmp_path / o / "model.safetensors").exists()
