"""The GPU check, in one go on one CUDA machine: `python -m bench.gpu --json` (or bench/gpu_check.sh).

Sections, each timed and recorded on its own (one failing does not lose the others):

  trainer   the current trainer (trainer.learner.Learner: replayed logprobs, truncated-IS policy
            gradient, AdamW) for --train-steps steps on SmolLM2-135M on CUDA, sharded by FSDP2
            (trainer.fsdp.shard: a world-1 NCCL group, bf16 parameters, fp32 reduction; --no-fsdp:
            unsharded with bf16 autocast); the bf16 delta between published states is kept for
            the sections below
  apply     the Triton delta-apply kernel on device tensors: `apply_sparse` on one flat bf16
            buffer the size of the model at several changed fractions, bytes touched / time vs
            the HBM roofline (--hbm-gb-s, H200 ~4800), checked bit-exact against the CPU path;
            and `delta_codec.apply_delta` of the trainer's real delta into device tensors
  engine    the torch engine (rollout_worker.torch_engine, device=cuda): decode tokens/s at 1, 8
            and 32 slots, then the trainer's delta applied on the device while 32 sequences
            decode: update stall in decode steps, versions switching mid-sequence
  vllm      the vLLM engine on the same folder: --slots sequences, the trainer's delta applied
            while they decode (every later token labelled with the new version), update stall in
            decode steps, and the mismatch k3 of a generation on the new weights vs the trainer's
            replay on them
  llama8b   (--llama8b) the trainer's step at Llama-3-8B's shapes, random weights made on the
            device: tokens/s, model FLOPs, MFU against the chip's bf16 peak (bench/gpu_llama8b.py)
  logprob_memory  (--logprob-memory) peak device memory of the trainer's log-prob path at Qwen2's
            152 k vocabulary, chunked vs whole, and the chunked logprobs checked against the whole
            (bench/gpu_logprob_memory.py)
  The last two run as child processes (`python -m bench.gpu_llama8b --json`, ...) after the
  others, each on a device this process has emptied; their JSON becomes the section.

Without CUDA it exits at once with status 2 and says why. `--dry-run` runs the same code on the
CPU with a tiny random Llama-layout model (vLLM only with --vllm: it takes minutes to start on a
CPU). `--random-init CONFIG.json` builds the model of an HF config.json with random weights, for
machines the prepared weights cannot reach (timings depend on the shapes, not the values).
Last line: one JSON object (also written to --out)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import delta_codec
import policy
from bus.events import SamplingParams

NO_CUDA = 2


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def model_folder(args, tmp: Path) -> Path:
    """The converted SmolLM2 folder, or (dry run) a tiny random Llama-layout model saved the same way."""
    if args.folder:
        return Path(args.folder)
    if args.random_init:
        from policy.hf import config_from_hf

        cfg = config_from_hf(json.loads(Path(args.random_init).read_text()))
        torch.manual_seed(args.seed)
        model = policy.Transformer(cfg).to(torch.bfloat16)
        return policy.save_hf_checkpoint(model, tmp / "random")
    if not args.dry_run:
        from asyncrl.model import prepare

        return prepare(args.model, args.cache)
    cfg = policy.ModelConfig.tiny(vocab_size=256, max_seq_len=256)
    torch.manual_seed(0)
    model = policy.Transformer(cfg).to(torch.bfloat16)
    return policy.save_hf_checkpoint(model, tmp / "tiny")


def samples(cfg, model, n: int, group: int, plen: int, clen: int, seed: int):
    """Rollout-shaped samples: random prompts, completions sampled from the model itself (so the
    behaviour logprobs are the model's), random rewards per group."""
    from trainer.learner import PackedSample

    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dev = next(model.parameters()).device
    prompts = [torch.randint(3, cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(n)]
    ids = torch.tensor(prompts, device=dev)
    lps = []
    with torch.no_grad():
        for _ in range(clen):  # plain ancestral sampling, full recompute: simple and exact
            logits = model(ids)[:, -1].float()
            lp = torch.log_softmax(logits, -1)
            nxt = torch.multinomial(lp.exp(), 1, generator=None)
            lps.append(lp.gather(1, nxt)[:, 0])
            ids = torch.cat([ids, nxt], 1)
    comps = ids[:, plen:].tolist()
    lps = torch.stack(lps, 1).tolist()
    return [
        PackedSample(
            f"r{i}",
            i // group,
            rng.random(),
            1.0,
            0,
            prompts[i],
            comps[i],
            lps[i],
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
            {"format": "full", "rows": clen},
            {},
        )
        for i in range(n)
    ]


def trainer_section(args, folder: Path, dev: torch.device) -> tuple[dict, dict, dict]:
    from trainer.learner import Learner
    from trainer.loss import LossConfig

    cfg, model = policy.load_hf_checkpoint(folder, device=dev)
    base = {k: v.cpu() for k, v in policy.inference_state(model).items()}
    batch = samples(cfg, model, args.batch, args.group, args.prompt_len, args.completion_len, args.seed)
    if args.fsdp:
        world_one(dev)
        from trainer.fsdp import shard

        shard(model, dev, mixed_precision=dev.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    learner = Learner(model, opt, LossConfig(), micro_batch=args.micro_batch or args.batch)
    steps = []
    # FSDP2's mixed-precision policy casts the parameters itself; unsharded runs use autocast
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dev.type == "cuda" and not args.fsdp
        else torch.autocast("cpu", enabled=False)
    )
    for i in range(args.train_steps):
        sync(dev)
        t0 = time.perf_counter()
        with amp:
            st = learner.step(batch)
        sync(dev)
        steps.append(
            {
                "step": i,
                "step_s": time.perf_counter() - t0,
                "loss": st["loss"],
                "grad_norm": st["grad_norm"],
                "k3_mean": st["k3_mean"],
            }
        )
    new = learner.publication.published_state()
    t0 = time.perf_counter()
    delta = delta_codec.encode_delta(base, new, from_version=0, to_version=1)
    enc_s = time.perf_counter() - t0
    tokens = args.batch * (args.prompt_len + args.completion_len)
    warm = steps[1:] or steps
    res = {
        "params": sum(t.numel() for t in base.values()),
        "steps": steps,
        "batch": args.batch,
        "tokens_per_step": tokens,
        "step_s_mean": sum(s["step_s"] for s in warm) / len(warm),
        "tokens_per_s": tokens / (sum(s["step_s"] for s in warm) / len(warm)),
        "fsdp": args.fsdp,
        "micro_batch": args.micro_batch or args.batch,
        "precision": (
            "fsdp2 bf16 params, fp32 reduce"
            if args.fsdp and dev.type == "cuda"
            else "bf16 autocast"
            if dev.type == "cuda"
            else "fp32"
        ),
        "delta": {
            "changed_frac": delta.stats.changed / delta.stats.total,
            "bytes": len(delta.to_bytes()),
            "encode_s": enc_s,
        },
    }
    if dev.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    del learner, opt, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res, base, {"delta": delta, "new": new, "cfg": cfg}


def world_one(dev: torch.device) -> None:
    """A one-process group (NCCL on CUDA) so trainer.fsdp shards exactly as under torchrun."""
    import os
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")


def time_it(fn, dev: torch.device, reps: int) -> float:
    fn()  # warm-up (Triton compiles here)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / reps


def apply_section(args, base: dict, upd: dict, dev: torch.device) -> dict:
    from delta_codec.triton_apply import apply_sparse, use_triton

    n = sum(t.numel() for t in base.values())
    g = torch.Generator().manual_seed(args.seed)
    flat = torch.cat([t.reshape(-1) for t in base.values()]).view(torch.int16)
    kernels = []
    for frac in args.fracs:
        k = max(1, int(n * frac))
        idx = torch.randperm(n, generator=g)[:k].sort().values
        d = torch.randint(-64, 64, (k,), generator=g, dtype=torch.int16)
        want = flat.clone()
        apply_sparse(want, idx, d, False)  # CPU reference (torch ops)
        bits, di, dd = flat.to(dev), idx.to(dev), d.to(dev)
        got = bits.clone()
        apply_sparse(got, di, dd, False)
        exact = bool(torch.equal(got.cpu(), want))
        # idx (8 B) + d (2 B) read, old bits read (2 B) and saved (2 B), new bits written (2 B)
        touched = k * (8 + 2 + 2 + 2 + 2)
        # B023: the lambda is called in this iteration only
        s = time_it(lambda: apply_sparse(bits, di, dd, False), dev, args.reps)  # noqa: B023
        row = {
            "changed_frac": frac,
            "changed": k,
            "bytes_touched": touched,
            "s": s,
            "gb_s": touched / s / 1e9,
            "bit_exact": exact,
            "path": "triton" if use_triton(bits) else "torch",
        }
        if dev.type == "cuda":
            row["frac_of_roofline"] = row["gb_s"] / args.hbm_gb_s
        kernels.append(row)
    big = large_buffer_rows(args, dev) if dev.type == "cuda" and args.apply_elems > n else []
    # the real delta from the trainer into device tensors, through the codec (host decode + kernel)
    delta = upd["delta"]
    blob = delta.to_bytes()
    delta_codec.apply_delta(
        {k: v.to(dev, copy=True) for k, v in base.items()}, delta_codec.Delta.from_bytes(blob)
    )
    state = {k: v.to(dev, copy=True) for k, v in base.items()}  # copy: on the CPU .to() would alias base
    sync(dev)
    t0 = time.perf_counter()
    delta_codec.apply_delta(state, delta_codec.Delta.from_bytes(blob))
    sync(dev)
    s = time.perf_counter() - t0
    exact = all(torch.equal(state[k].cpu().view(torch.int16), upd["new"][k].view(torch.int16)) for k in state)
    full = 2 * n
    return {
        "device": str(dev),
        "hbm_gb_s": args.hbm_gb_s if dev.type == "cuda" else None,
        "kernel": kernels,
        "kernel_large": big,
        "codec_apply": {
            "s": s,
            "model_gb_s": full / s / 1e9,
            "changed_frac": delta.stats.changed / delta.stats.total,
            "bit_exact": exact,
        },
    }


def large_buffer_rows(args, dev: torch.device) -> list[dict]:
    """The kernel on a buffer of --apply-elems bf16 elements (a multi-billion-parameter model's
    size), indices drawn on the device; checked against the same arithmetic in plain torch ops."""
    from delta_codec.triton_apply import apply_sparse

    N = args.apply_elems
    g = torch.Generator(device=dev).manual_seed(args.seed)
    bits = torch.randint(-(2**15), 2**15, (N,), generator=g, dtype=torch.int32, device=dev).to(torch.int16)
    rows = []
    for frac in args.fracs:
        k = max(1, int(N * frac))
        idx = torch.randperm(N, generator=g, device=dev)[:k].sort().values
        d = torch.randint(-64, 64, (k,), generator=g, dtype=torch.int32, device=dev).to(torch.int16)
        want = bits.clone()
        w = want[idx].to(torch.int32) + d.to(torch.int32)
        want[idx] = (((w + 2**15) % 2**16) - 2**15).to(torch.int16)  # wrap at 16 bits
        got = bits.clone()
        apply_sparse(got, idx, d, False)
        exact = bool(torch.equal(got, want))
        del want, got
        touched = k * (8 + 2 + 2 + 2 + 2)
        # B023: the lambda is called in this iteration only
        s = time_it(lambda: apply_sparse(bits, idx, d, False), dev, args.reps)  # noqa: B023
        rows.append(
            {
                "elements": N,
                "changed_frac": frac,
                "changed": k,
                "bytes_touched": touched,
                "s": s,
                "gb_s": touched / s / 1e9,
                "frac_of_roofline": touched / s / 1e9 / args.hbm_gb_s,
                "bit_exact": exact,
            }
        )
        torch.cuda.empty_cache()
    return rows


async def engine_section(args, base: dict, upd: dict, dev: torch.device) -> dict:
    """The torch engine on the device: tokens/s per slot count, then a delta applied mid-decode."""
    from rollout_worker.torch_engine import TorchEngine

    cfg = upd["cfg"]
    max_len = args.prompt_len + args.gen_tokens + 8
    g = torch.Generator().manual_seed(args.seed)

    def prompts(n):
        return [torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(n)]

    sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.gen_tokens)
    out = {"device": str(dev), "prompt_len": args.prompt_len, "gen_tokens": args.gen_tokens, "throughput": []}
    for slots in args.engine_slots:
        eng = TorchEngine(cfg, slots=slots, max_len=max_len, seed=args.seed, device=dev)
        try:
            await eng.load_keyframe(base, version=0, epoch=1)
            await eng.generate(prompts(1)[0], SamplingParams(temperature=1.0, max_tokens=4))  # warm-up
            sync(dev)
            t0 = time.perf_counter()
            gens = await asyncio.gather(*(eng.generate(p, sp, seed=i) for i, p in enumerate(prompts(slots))))
            wall = time.perf_counter() - t0
            st = eng.stats()
            tok = sum(len(x.completion_ids) for x in gens)
            out["throughput"].append(
                {
                    "slots": slots,
                    "tokens": tok,
                    "tokens_per_s": tok / wall,
                    "decode_step_ms_p50": st["decode_step_ms_p50"],
                }
            )
        finally:
            await eng.close()
    # the in-flight delta: applied on the device (Triton) while every slot decodes
    slots = max(args.engine_slots)
    eng = TorchEngine(cfg, slots=slots, max_len=max_len, seed=args.seed, device=dev)
    try:
        await eng.load_keyframe(base, version=0, epoch=1)
        before = eng.stats()["tokens"]
        tasks = [asyncio.create_task(eng.generate(p, sp, seed=i)) for i, p in enumerate(prompts(slots))]
        while eng.stats()["tokens"] - before < slots * args.gen_tokens // 3:
            await asyncio.sleep(0.002)
        t0 = time.perf_counter()
        await eng.apply_delta(delta_codec.Delta.from_bytes(upd["delta"].to_bytes()), epoch=1)
        call_s = time.perf_counter() - t0
        gens = await asyncio.gather(*tasks)
        st = eng.stats()
        exact = all(
            torch.equal(eng.state[k].cpu().view(torch.int16), upd["new"][k].view(torch.int16))
            for k in eng.state
        )
        out["inflight_delta"] = {
            "slots": slots,
            "state_on": str(next(iter(eng.state.values())).device),
            "bit_exact": exact,
            "switched_mid_sequence": sum(1 for x in gens if 0 in x.token_versions and 1 in x.token_versions),
            "versions_ordered": all(x.token_versions == sorted(x.token_versions) for x in gens),
            "apply_call_s": call_s,
            "update_apply_ms_p50": st["update_apply_ms_p50"],
            "update_stall_ms_p50": st["update_stall_ms_p50"],
            "update_stall_steps_p50": st["update_stall_steps_p50"],
            "step_gap_ms_p50": st["step_gap_ms_p50"],
            "decode_step_ms_p50": st["decode_step_ms_p50"],
            "update_stall_decode_steps": st["update_stall_ms_p50"] / st["step_gap_ms_p50"]
            if st["update_stall_ms_p50"] is not None and st["step_gap_ms_p50"]
            else None,
        }
    finally:
        await eng.close()
    return out


async def vllm_section(args, folder: Path, base: dict, upd: dict, dev: torch.device) -> dict:
    from rollout_worker.sections import EngineSection
    from rollout_worker.vllm_engine import VLLMEngine

    cfg = upd["cfg"]
    kw = {"enforce_eager": True} if dev.type == "cpu" else {"gpu_memory_utilization": args.gpu_mem}
    eng = VLLMEngine(
        EngineSection(kind="vllm", model=str(folder), slots=args.slots, max_len=args.max_len, seed=args.seed),
        model_config=cfg.to_dict(),
        eos_id=None,
        **kw,
    )
    t0 = time.perf_counter()
    try:
        await eng.load_keyframe(base, version=0, epoch=1)
        start_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(args.seed)
        prompts = [
            torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.slots)
        ]
        sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.gen_tokens)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(eng.generate(p, sp, seed=i)) for i, p in enumerate(prompts)]

        async def a_third_decoded():
            while len(eng._reqs) < len(tasks) or not all(
                len(r.tokens) >= args.gen_tokens // 3 for r in eng._reqs.values()
            ):
                await asyncio.sleep(0.002)

        await asyncio.wait_for(a_third_decoded(), timeout=180)
        await eng.apply_delta(delta_codec.Delta.from_bytes(upd["delta"].to_bytes()), epoch=1)
        gens = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        switched = sum(1 for x in gens if 0 in x.token_versions and 1 in x.token_versions)
        ordered = all(x.token_versions == sorted(x.token_versions) for x in gens)
        st = eng.stats()
        # mismatch: a generation on the new weights vs the trainer's replay on them (fp32 on bf16 weights)
        after = await asyncio.gather(*(eng.generate(p, sp, seed=100 + i) for i, p in enumerate(prompts)))
        model = policy.Transformer(cfg).to(dev).eval()
        model.load_inference_state({k: v.to(dev) for k, v in upd["new"].items()})
        scfg = policy.SamplingConfig(temperature=1.0)
        with torch.no_grad():
            res = policy.sequence_logprobs(
                model,
                prompts,
                [x.completion_ids for x in after],
                scfg,
                [policy.SamplingMask.from_wire(x.sampling_mask) for x in after],
            )
        b = torch.zeros_like(res.logprobs, dtype=torch.float64)
        for i, x in enumerate(after):
            b[i, : len(x.logprobs)] = torch.tensor(x.logprobs, dtype=torch.float64)
        mm = policy.mismatch_metrics(b, res.logprobs.cpu(), res.valid.cpu())
        tokens = sum(len(x.completion_ids) for x in gens)
        return {
            "start_s": start_s,
            "slots": args.slots,
            "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "in_place": eng.in_place,
            "switched_mid_sequence": switched,
            "versions_ordered": ordered,
            "update_sent_bytes": st.get("update_sent_bytes"),
            "update_stall_ms_p50": st["update_stall_ms_p50"],
            "update_stall_steps_p50": st["update_stall_steps_p50"],
            "decode_step_ms_p50": st["decode_step_ms_p50"],
            "update_apply_ms_p50": st["update_apply_ms_p50"],
            "step_gap_ms_p50": st["step_gap_ms_p50"],
            # the stall in decode steps, from the two medians (the engine's own figure needs a longer window)
            "update_stall_decode_steps": st["update_stall_ms_p50"] / st["step_gap_ms_p50"]
            if st["step_gap_ms_p50"]
            else None,
            "k3_vs_replay": mm["k3_mean"],
        }
    finally:
        await eng.close()


CHILD_SECTIONS = {"llama8b": "bench.gpu_llama8b", "logprob_memory": "bench.gpu_logprob_memory"}


def child_section(args, name: str, dev: torch.device) -> dict:
    """Run a section's module as a child process on the emptied device; its JSON line is the result."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the child needs the device's memory, not this process's cache
    cmd = [sys.executable, "-m", CHILD_SECTIONS[name], "--json", "--seed", str(args.seed)]
    if args.dry_run:
        cmd.append("--dry-run")
    if name == "llama8b" and args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    sys.stderr.write(p.stderr[-4000:])
    lines = p.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(
            f"{CHILD_SECTIONS[name]} exited {p.returncode} without a result: {p.stderr[-500:]}"
        )
    res = json.loads(lines[-1])
    if p.returncode != 0:
        raise RuntimeError(f"{CHILD_SECTIONS[name]} exited {p.returncode}: {res.get('error', res)}")
    return res


def vllm_importable() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 — any import failure means: no vLLM here, say which
        return f"vllm does not import: {type(e).__name__}: {e}"
    return None


def gpu_or_dry_run(dry_run: bool, name: str) -> torch.device:
    """The CPU for a `--dry-run` (tiny sizes), else the first GPU; none: exit NO_CUDA, saying why."""
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(
            f"{name}: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "this check needs one GPU. `--dry-run` runs the same code on the CPU at a tiny size.",
            file=sys.stderr,
        )
        raise SystemExit(NO_CUDA)
    return torch.device("cuda", 0)


def run(args) -> dict:
    dev = gpu_or_dry_run(args.dry_run, "bench.gpu")
    out = {
        "bench": "gpu",
        "dry_run": args.dry_run,
        "device": str(dev),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "sections": {},
    }
    errors = out["errors"] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="asyncrl-gpu-") as tmp:
        folder = model_folder(args, Path(tmp))
        out["folder"] = str(folder)

        def section(name, fn):
            t0 = time.perf_counter()
            try:
                r = fn()
                out["sections"][name] = r
                return r
            except Exception as e:  # noqa: BLE001 — recorded in the JSON; the other sections still run
                errors[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stderr)
                return None
            finally:
                out.setdefault("section_s", {})[name] = time.perf_counter() - t0
                write(args, out)

        tr = section("trainer", lambda: trainer_section(args, folder, dev))
        if tr is None:
            out["sections"]["apply"] = out["sections"]["vllm"] = {"skipped": "the trainer section failed"}
        else:
            out["sections"]["trainer"], base, upd = tr
            section("apply", lambda: apply_section(args, base, upd, dev))
            section("engine", lambda: asyncio.run(engine_section(args, base, upd, dev)))
            why = vllm_importable() or (
                None
                if (dev.type == "cuda" or args.vllm)
                else "dry run without --vllm (vLLM takes minutes to start on a CPU)"
            )
            if why:
                out["sections"]["vllm"] = {"skipped": why}
            else:
                section("vllm", lambda: asyncio.run(vllm_section(args, folder, base, upd, dev)))
        for name, on in (("llama8b", args.llama8b), ("logprob_memory", args.logprob_memory)):
            if on:
                # B023: the lambda is called in this iteration only
                section(name, lambda: child_section(args, name, dev))  # noqa: B023
    out["total_s"] = time.perf_counter() - t_all
    out["ok"] = not errors
    write(args, out)
    return out


def write(args, out: dict) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))


def run_reported(name: str, args, run_fn) -> dict:
    """One child check (bench/gpu_*.py) as its JSON report: `run_fn(args)`'s result, or the error it
    raised (traceback on stderr), with total_s; written to --out, shown indented on stderr unless
    --json, and printed as the last line."""
    t0 = time.perf_counter()
    try:
        res = run_fn(args)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 — reported in the JSON, with the traceback on stderr
        traceback.print_exc(file=sys.stderr)
        res = {"bench": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
    res["total_s"] = time.perf_counter() - t0
    write(args, res)
    if not args.json:
        print(json.dumps(res, indent=1, default=str), file=sys.stderr)
    print(json.dumps(res, default=str))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny random model, same code paths")
    ap.add_argument("--vllm", action="store_true", help="dry run: run the vLLM section too (slow on a CPU)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--cache", default=None, help="model cache (default $ASYNCRL_CACHE or ~/.cache/asyncrl)")
    ap.add_argument("--folder", default=None, help="an HF folder to use instead of a prepared model")
    ap.add_argument("--out", default=None, help="write the JSON here as well (after every section)")
    ap.add_argument("--train-steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per trainer step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--completion-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument(
        "--fracs",
        type=float,
        nargs="+",
        default=[0.01, 0.1, 1.0],
        help="changed fractions for the apply kernel",
    )
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--hbm-gb-s", type=float, default=4800.0, help="HBM roofline (H200: ~4.8 TB/s)")
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--engine-slots", type=int, nargs="+", default=None, help="torch engine slot counts")
    ap.add_argument(
        "--apply-elems", type=int, default=None, help="CUDA: also time the kernel on a buffer this big"
    )
    ap.add_argument("--random-init", default=None, help="an HF config.json: random weights of that model")
    ap.add_argument(
        "--no-fsdp", dest="fsdp", action="store_false", help="unsharded trainer with bf16 autocast"
    )
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--gen-tokens", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama8b", action="store_true", help="also the 8 B trainer step (bench/gpu_llama8b.py)")
    ap.add_argument(
        "--logprob-memory",
        action="store_true",
        help="also the 152 k log-prob memory (bench/gpu_logprob_memory.py)",
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="llama8b: the chip's dense bf16 peak")
    ap.add_argument("--child-timeout", type=float, default=240.0, help="seconds for each child section")
    args = ap.parse_args(argv)
    # tiny on the CPU, real on the GPU; explicit flags win
    sizes = (
        {
            "train_steps": 2,
            "batch": 4,
            "prompt_len": 8,
            "completion_len": 8,
            "reps": 2,
            "slots": 2,
            "gen_tokens": 12,
            "engine_slots": [1, 2],
            "apply_elems": 0,
        }
        if args.dry_run
        else {
            "train_steps": 5,
            "batch": 32,
            "prompt_len": 128,
            "completion_len": 256,
            "reps": 20,
            "slots": 32,
            "gen_tokens": 256,
            "engine_slots": [1, 8, 32],
            "apply_elems": 1 << 30,
        }
    )
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_len is None:
        args.max_len = args.prompt_len + args.gen_tokens + 8
    if args.dry_run:
        args.group = min(args.group, args.batch)
    res = run(args)
    if not args.json:
        print(json.dumps(res, indent=1, default=str), file=sys.stderr)
    print(json.dumps(res, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
