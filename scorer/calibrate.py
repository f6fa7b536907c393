"""`asyncrl calibrate-cost`: λ from the policy's own test-time scaling curve.

    for each budget B (max new tokens, samples per task, or an episode's turns):
                      run the policy on held-out tasks → (mean cost in its own tokens, success)
    fit   s(c) = a − b·exp(−c/τ)      (b ≥ 0, τ > 0: monotone increasing and concave)
    λ   = s'(c*) = (b/τ)·exp(−c*/τ)   at the operating point c*: the mean cost at a given budget,
                                      or the cost where the slope equals a given price of compute
With reward = success − λ·cost, a policy at c* gains nothing by spending one more token: the
penalty's marginal price equals the marginal success that token buys. `--apply` writes λ to
KV rl-control/lambda (scorers pick it up live); a PNG shows points, fit and tangent.

On a multi-turn env (e.g. swe-demo) the held-out tasks are played as episodes (envs/held_out.py, as
the trainer's eval plays them), success = resolved, cost = the policy's tokens (its turns; prompt
and command output are not its doing and are not priced, as the scorer's cost_unit "tokens"
counts them): `--axis samples` k episodes a task (resolved by any), `--axis turns` one episode
capped at max_turns = the budget. A policy whose success stops rising before its turn limit has a
tangent of ~0 on the turns axis (its last turns buy nothing), while a second attempt still buys
success: the samples axis prices that.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from kernel.cli import Command, one_of, run


@dataclass(frozen=True)
class ScalingFit:
    a: float  # asymptotic success
    b: float  # success still to gain at cost 0
    tau: float  # cost scale (tokens) of the gain
    rmse: float

    def success(self, c):
        return self.a - self.b * np.exp(-np.asarray(c, dtype=np.float64) / self.tau)

    def slope(self, c):
        return self.b / self.tau * np.exp(-np.asarray(c, dtype=np.float64) / self.tau)


def _best_ab(costs: np.ndarray, succ: np.ndarray, w: np.ndarray, taus: np.ndarray, a_max: float):
    """For every τ at once: weighted least squares of s = a − b·e (e = exp(−c/τ)) with b ≥ 0 and
    a ≤ a_max (success cannot exceed 1: without it a convex start would fit a line through a > 1)."""
    e = np.exp(-costs[None, :] / taus[:, None])  # [T, N]
    sw, se, see = w.sum(), (w * e).sum(1), (w * e * e).sum(1)
    ss, sse_ = (w * succ).sum(), (w * succ * e).sum(1)
    det = sw * see - se * se
    with np.errstate(divide="ignore", invalid="ignore"):
        a = (ss * see - se * sse_) / det
        b = (ss * se - sw * sse_) / det  # s = a − b·e  ⇒  slope on e is −b
    capped = np.isfinite(a) & (a > a_max)  # a at its bound: b by LS given a
    b = np.where(capped, (w * e * (a_max - succ[None, :])).sum(1) / see, b)
    a = np.where(capped, a_max, a)
    flat = ~np.isfinite(b) | (b < 0)  # non-increasing data: flat fit
    a = np.where(flat, min(ss / sw, a_max), a)
    b = np.where(flat, 0.0, b)
    err = (w * (succ[None, :] - (a[:, None] - b[:, None] * e)) ** 2).sum(1) / sw
    return a, b, err


def fit_scaling_curve(costs, successes, weights=None, a_max: float = 1.0) -> ScalingFit:
    """Monotone concave fit s(c) = a − b·exp(−c/τ) of success against cost (coarse-to-fine over τ)."""
    c = np.asarray(costs, dtype=np.float64)
    s = np.asarray(successes, dtype=np.float64)
    w = np.ones_like(c) if weights is None else np.asarray(weights, dtype=np.float64)
    if c.shape != s.shape or c.ndim != 1 or w.shape != c.shape:
        raise ValueError(
            f"costs, successes (and weights) must be 1-d and the same length, got {c.shape} {s.shape}"
        )
    if len(np.unique(c)) < 3:
        raise ValueError(
            f"need successes at >= 3 distinct costs to fit a curve, got {sorted(set(c.tolist()))}"
        )
    if not (np.isfinite(c).all() and np.isfinite(s).all()) or (c < 0).any() or (w <= 0).any():
        raise ValueError("costs must be finite and >= 0, successes finite, weights > 0")
    span = c.max() - c.min()
    lo, hi = math.log(max(span, 1e-9) / 200), math.log(max(span, 1e-9) * 20)
    for _ in range(3):  # each pass zooms in around the best τ
        taus = np.exp(np.linspace(lo, hi, 256))
        a, b, err = _best_ab(c, s, w, taus, a_max)
        i = int(np.argmin(err))
        step = (hi - lo) / 255
        lo, hi = math.log(taus[i]) - 2 * step, math.log(taus[i]) + 2 * step
    return ScalingFit(float(a[i]), float(b[i]), float(taus[i]), float(math.sqrt(err[i])))


def tangent_slope(fit: ScalingFit, at: float) -> float:
    """ds/dc of the fitted curve at cost `at` (success per unit of cost: λ)."""
    return float(fit.slope(at))


def cost_at_price(fit: ScalingFit, price: float) -> float:
    """The cost where the curve's slope equals `price` (0 when even the first token is not worth it)."""
    if price <= 0:
        raise ValueError(f"price must be > 0, got {price}")
    if fit.b <= 0 or fit.b / fit.tau <= price:
        return 0.0
    return fit.tau * math.log(fit.b / (fit.tau * price))


# -- measuring the curve with the current policy ---------------------------------------------


def load_policy_file(path: str):
    """A trainer checkpoint (a torch.save'd dict with "model" and "model_config"), or a directory of them."""
    import torch

    from policy import ModelConfig, Transformer

    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("ckpt-*.pt"))
        if not files:
            raise FileNotFoundError(f"no ckpt-*.pt checkpoint in {p}")
        p = files[-1]
    raw = torch.load(p, map_location="cpu", weights_only=True)  # tensors only: never runs code
    if not isinstance(raw, dict) or "model" not in raw or "model_config" not in raw:
        raise ValueError(f"{p} is not a policy checkpoint (needs 'model' and 'model_config')")
    model = Transformer(ModelConfig.from_dict(raw["model_config"]))
    model.load_state_dict(raw["model"])
    return model.eval(), f"{p} (version {raw.get('version', '?')})"


async def load_policy_bus(url: str):
    from bus import BusConfig, connect
    from bus.weights.follower import WeightFollower
    from policy import ModelConfig, Transformer

    bus = await connect(BusConfig(servers=url.split(","), name="calibrate-cost"))
    try:
        target = await asyncio.wait_for(WeightFollower(bus, name="calibrate").latest_state(), 60)
    finally:
        await bus.close()
    if target.state is None:
        raise RuntimeError(f"no keyframe on {url}")
    model = Transformer(ModelConfig.from_dict(target.model_config))
    model.load_inference_state(target.state)
    return model.eval(), f"bus {url} (version {target.version})"


def measure(
    model,
    env_name: str,
    budgets: list[int],
    n_prompts: int,
    temperature: float,
    seed: int,
    tok=None,
    chat: bool = False,
) -> list[dict]:
    """Success and mean generated tokens at each budget, on the same held-out prompts."""
    import torch

    from envs import get_env
    from envs.feeder import prompt_ids
    from policy import CharTokenizer, SamplingConfig, generate

    env, tok = get_env(env_name), tok or CharTokenizer.default()
    rng = random.Random(seed)
    tasks = [env.sample(rng, split="eval") for _ in range(n_prompts)]
    prompts = prompt_ids(tok, [t.prompt for t in tasks], chat)
    rows = []
    for budget in budgets:
        gen = torch.Generator().manual_seed(seed)
        outs = generate(model, prompts, SamplingConfig(temperature=temperature), budget, [tok.eos_id], gen)
        texts = [tok.decode([i for i in o.ids if i != tok.eos_id]) for o in outs]
        succ = np.array([env.verify(x, t.spec).success for x, t in zip(texts, tasks)])
        cost = np.array([len(o.ids) for o in outs], dtype=np.float64)
        rows.append(
            {"budget": budget, "cost": float(cost.mean()), "success": float(succ.mean()), "n": len(outs)}
        )
    return rows


def measure_samples(
    model,
    env_name: str,
    ks: list[int],
    n_prompts: int,
    temperature: float,
    seed: int,
    max_tokens: int,
    tok=None,
    chat: bool = False,
) -> list[dict]:
    """Samples-per-task budgets: k samples of each held-out prompt; success = any of the k correct
    (a verifier picks), cost = tokens of all k. One generation of max(k) samples serves every k."""
    import torch

    from envs import get_env
    from envs.feeder import prompt_ids
    from policy import CharTokenizer, SamplingConfig, generate

    env, tok = get_env(env_name), tok or CharTokenizer.default()
    rng, K = random.Random(seed), max(ks)
    tasks = [env.sample(rng, split="eval") for _ in range(n_prompts)]
    prompts = prompt_ids(tok, [t.prompt for t in tasks for _ in range(K)], chat)
    outs = generate(
        model,
        prompts,
        SamplingConfig(temperature=temperature),
        max_tokens,
        [tok.eos_id],
        torch.Generator().manual_seed(seed),
    )
    ok = np.array(
        [
            env.verify(tok.decode([i for i in o.ids if i != tok.eos_id]), tasks[j // K].spec).success
            for j, o in enumerate(outs)
        ]
    ).reshape(n_prompts, K)
    toks = np.array([len(o.ids) for o in outs], dtype=np.float64).reshape(n_prompts, K)
    return [
        {
            "budget": k,
            "cost": float(toks[:, :k].sum(1).mean()),
            "success": float(ok[:, :k].max(1).mean()),
            "n": n_prompts,
        }
        for k in ks
    ]


def measure_turns(
    model, env_name: str, budgets: list[int], n_prompts: int, temperature: float, seed: int, tok=None
) -> list[dict]:
    """Turn budgets: the same held-out episodes played at each max_turns -> resolved rate and the
    policy's tokens an episode (envs/held_out.py, lockstep, seeded: budgets differ only in turns)."""
    from envs.held_out import eval_specs, play_held_out
    from policy import CharTokenizer, SamplingConfig

    tok = tok or CharTokenizer.default()
    specs = [s.spec for _, s in eval_specs([env_name], n_prompts, seed)]
    rows = []
    for budget in budgets:
        capped = [{**s, "limits": {**s["limits"], "max_turns": budget}} for s in specs]
        ev = play_held_out(model, tok, capped, SamplingConfig(temperature=temperature), seed)
        rows.append(
            {
                "budget": budget,
                "cost": ev["eval_model_tokens"],
                "success": ev["eval_success"],
                "turns": ev["eval_turns"],
                "n": ev["eval_n"],
            }
        )
    return rows


def measure_episode_samples(
    model, env_name: str, ks: list[int], n_prompts: int, temperature: float, seed: int, tok=None
) -> list[dict]:
    """Samples-per-task budgets on episodes: k attempts at each held-out task, success = any of
    them resolved (the hidden tests pick), cost = the policy's tokens of all k. One pass of
    max(k) episodes per task, in lockstep, serves every k."""
    from envs.held_out import eval_specs, play_held_out
    from policy import CharTokenizer, SamplingConfig

    tok, K = tok or CharTokenizer.default(), max(ks)
    specs = [s.spec for _, s in eval_specs([env_name], n_prompts, seed)]
    played: list[tuple[bool, int]] = []
    play_held_out(
        model,
        tok,
        [s for s in specs for _ in range(K)],
        SamplingConfig(temperature=temperature),
        seed,
        on_scored=lambda ep, r: played.append((bool(r.resolved), ep.action_tokens)),
    )
    ok = np.array([p[0] for p in played]).reshape(len(specs), K)
    toks = np.array([p[1] for p in played], dtype=np.float64).reshape(len(specs), K)
    return [
        {
            "budget": k,
            "cost": float(toks[:, :k].sum(1).mean()),
            "success": float(ok[:, :k].max(1).mean()),
            "n": len(specs),
        }
        for k in ks
    ]


def multi_turn(env_name: str, seed: int = 0) -> bool:
    """Whether the env's tasks are episodes (its eval specs carry one)."""
    from envs.held_out import eval_specs

    return all("episode" in s.spec for _, s in eval_specs([env_name], 1, seed))


def plot(rows: list[dict], fit: ScalingFit, at: float, lam: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = np.array([r["cost"] for r in rows])
    s = np.array([r["success"] for r in rows])
    xs = np.linspace(0, max(c.max(), at) * 1.1, 200)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.scatter(c, s, color="k", zorder=3, label="measured (one point per budget)")
    for r in rows:
        ax.annotate(
            f"B={r['budget']}",
            (r["cost"], r["success"]),
            textcoords="offset points",
            xytext=(4, -10),
            fontsize=7,
        )
    ax.plot(xs, fit.success(xs), label=f"fit  {fit.a:.3f} − {fit.b:.3f}·exp(−c/{fit.tau:.1f})")
    ax.plot(xs, fit.success(at) + lam * (xs - at), "--", label=f"tangent at c={at:.1f}: λ={lam:.5f}/token")
    ax.axvline(at, color="grey", lw=0.5)
    ax.set(xlabel="cost (mean generated tokens per task)", ylabel="success", title=title, ylim=(-0.05, 1.05))
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def apply_lambda(url: str, lam: float) -> int:
    from bus import BusConfig, connect
    from bus import topology as topo
    from bus.control import format_lambda

    bus = await connect(BusConfig(servers=url.split(","), name="calibrate-cost"))
    try:
        return await bus.kv_put(topo.KEY_LAMBDA, format_lambda(lam))
    finally:
        await bus.close()


@click.command("calibrate-cost", cls=Command, help=__doc__)
@click.option("--checkpoint", help="trainer checkpoint file, or a directory (newest ckpt-*.pt)")
@click.option("--random-init", is_flag=True, help="an untrained tiny model (smoke test)")
@click.option(
    "--model",
    help="a pretrained model folder (HF config, safetensors, tokenizer.json), e.g. "
    "the one `asyncrl model prepare smollm2` writes",
)
@click.option(
    "--chat-template",
    is_flag=True,
    help="prompts as the user turn of the tokenizer's chat template (as [trainer] chat_template)",
)
@click.option(
    "--nats",
    default=None,
    help="server URL(s): policy from the latest keyframe (when no --checkpoint) and where --apply writes λ",
)
@click.option("--env", default="arith")
@click.option(
    "--axis",
    type=click.Choice(("tokens", "samples", "turns")),
    default="tokens",
    help="budget = max new tokens per sample, samples per task (at --max-tokens each), or an"
    " episode's max_turns (multi-turn envs)",
)
@click.option(
    "--budgets",
    default=None,
    help="budgets, comma separated (default: 4,6,8,12,16,20,24,32,40,48 tokens, 1,2,3,4,6,8 samples,"
    " 1,2,3,4,5,6 turns)",
)
@click.option("--max-tokens", type=int, default=48, help="max new tokens per sample on the samples axis")
@click.option("--prompts", type=int, default=128, help="held-out prompts per budget")
@click.option("--temperature", type=float, default=1.0)
@click.option(
    "--budget",
    type=int,
    help="operating point: the mean cost at this budget (default: the largest"
    " budget, i.e. the training max_tokens)",
)
@click.option("--price", type=float, help="operating point: where the curve's slope equals this price")
@click.option("--apply", is_flag=True, help="write λ to KV rl-control/lambda (needs --nats)")
@click.option("--out", default="runs/calibrate-cost.png", help="plot path (a .json summary goes next to it)")
@click.option("--seed", type=int, default=0)
def cli(**flags) -> int:
    a = SimpleNamespace(**flags)
    one_of(a, "checkpoint", "random_init", "model")  # where the policy comes from
    one_of(a, "budget", "price")  # the operating point
    if a.apply and not a.nats:
        raise click.UsageError("--apply needs --nats")
    default = {"tokens": "4,6,8,12,16,20,24,32,40,48", "samples": "1,2,3,4,6,8", "turns": "1,2,3,4,5,6"}
    a.budgets = a.budgets or default[a.axis]
    try:
        budgets = sorted(
            {int(x) for x in a.budgets.split(",") if x.strip()} | ({a.budget} if a.budget else set())
        )
    except ValueError:
        raise click.UsageError(f"--budgets must be integers, got {a.budgets!r}") from None
    if len(budgets) < 3 or budgets[0] < 1:
        raise click.UsageError("--budgets needs >= 3 positive budgets")

    import torch

    torch.manual_seed(a.seed)
    tok = None
    if a.model:
        import policy

        try:
            _, model = policy.load_hf_checkpoint(a.model)
            tok, source = policy.load_hf_tokenizer(a.model), a.model
        except Exception as e:  # missing folder, unreadable or unsupported model
            print(f"asyncrl calibrate-cost: cannot load model: {e}", file=sys.stderr)
            return 2
        model.eval()
    elif a.checkpoint:
        try:
            model, source = load_policy_file(a.checkpoint)
        except Exception as e:  # missing, unreadable (pickle errors too) or not fitting the model
            print(f"asyncrl calibrate-cost: cannot load policy: {e}", file=sys.stderr)
            return 2
    elif a.random_init:
        from policy import CharTokenizer, ModelConfig, Transformer

        model, source = (
            Transformer(ModelConfig.tiny(vocab_size=CharTokenizer.default().vocab_size)).eval(),
            "random init",
        )
    elif a.nats:
        model, source = asyncio.run(load_policy_bus(a.nats))
    else:
        raise click.UsageError("give --checkpoint, --model, --nats (latest keyframe) or --random-init")
    if a.chat_template and tok is None:
        raise click.UsageError("--chat-template needs --model (the char tokenizer has no chat template)")

    try:
        episodes = multi_turn(a.env, a.seed)
    except KeyError as e:  # no such env
        print(f"asyncrl calibrate-cost: {e.args[0]}", file=sys.stderr)
        return 2
    if a.axis == "turns" and not episodes:
        print(
            f"asyncrl calibrate-cost: --axis turns needs a multi-turn env; {a.env!r} has single-answer tasks",
            file=sys.stderr,
        )
        return 2
    if a.axis == "turns":
        rows = measure_turns(model, a.env, budgets, a.prompts, a.temperature, a.seed, tok)
    elif a.axis == "samples" and episodes:
        rows = measure_episode_samples(model, a.env, budgets, a.prompts, a.temperature, a.seed, tok)
    elif a.axis == "tokens":
        rows = measure(model, a.env, budgets, a.prompts, a.temperature, a.seed, tok, a.chat_template)
    else:
        rows = measure_samples(
            model, a.env, budgets, a.prompts, a.temperature, a.seed, a.max_tokens, tok, a.chat_template
        )
    for r in rows:
        print(f"budget {r['budget']:4d}  cost {r['cost']:7.2f}  success {r['success']:.3f}", file=sys.stderr)
    fit = fit_scaling_curve([r["cost"] for r in rows], [r["success"] for r in rows])
    if a.price is not None:
        at, how = cost_at_price(fit, a.price), f"slope = price {a.price}"
    else:
        b = a.budget or budgets[-1]
        at, how = next(r["cost"] for r in rows if r["budget"] == b), f"budget {b}"
    lam = tangent_slope(fit, at)
    if fit.b == 0:
        print("warning: success does not rise with cost: λ = 0 (is the policy trained?)", file=sys.stderr)
    plot(rows, fit, at, lam, a.out, f"{a.env}: {source}")
    summary = {
        "lambda": lam,
        "operating_cost": at,
        "operating_point": how,
        "axis": a.axis,
        "fit": asdict(fit),
        "points": rows,
        "policy": source,
        "env": a.env,
        "plot": a.out,
    }
    if a.apply:
        summary["kv_revision"] = asyncio.run(apply_lambda(a.nats, lam))
    Path(os.path.splitext(a.out)[0] + ".json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl calibrate-cost")


if __name__ == "__main__":
    sys.exit(main())
