"""TRL's GRPOTrainer on the task asyncrl learns, saving its policy at fixed training-clock points.

    .venv-peer/bin/python -m bench.peer_trl --model DIR --out DIR [--minutes 15] [--every-s 60]
                                            [--env arith-chat-12] [--max-new-tokens 24]
                                            [--max-steps 0] [--seed 0] [--json]

The synchronous peer of bench.peer, run in `.venv-peer` (`make peer-venv`: TRL pinned) on the same HF
folder asyncrl trains (SmolLM2-135M-Instruct from the model cache), with asyncrl's settings:

  batch        4 prompts x 4 completions per optimizer step (per_device_train_batch_size 16,
               num_generations 4, one step per generation, no accumulation)
  sampling     temperature 0.7, top_p 1, no top-k, 24 new tokens (--max-new-tokens)
  loss         beta 0 (no KL), scale_rewards "none" (advantage = reward - group mean), loss_type
               "dapo" (token mean over the whole batch, as asyncrl's), one iteration per batch
  optimizer    AdamW on fp32 weights (fused), lr 1e-5, betas (0.9, 0.95), no weight decay, grad
               clip 1.0, linear warmup lr/2 -> lr over 2 steps then constant (asyncrl's schedule;
               HF's own warmup would start at lr 0)
  tasks        the env's train split (--env: `arith-chat-12` prompts in words, or `python-funcs`
               functions asked in words, through the tokenizer's chat template) and the project's
               verifier as the reward function

The clock starts when training starts (model loaded) and stops the run at --minutes. After the
first step that ends past each --every-s mark, and after the last step, the policy is saved in fp32
(the weights TRL samples from) with its clock reading; the save itself is off the clock (the clock
excludes it). OUT/curve.json: the settings, each saved policy (wall_s, step, folder) and each step's
reward mean. Last stdout line with --json: the same object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ENV = "arith-chat-12"
SETTINGS = {
    "prompts_per_step": 4,
    "completions_per_prompt": 4,
    "lr": 1e-5,
    "warmup_steps": 2,
    "betas": [0.9, 0.95],
    "grad_clip": 1.0,
    "temperature": 0.7,
    "top_p": 1.0,
    "max_new_tokens": 24,
    "kl": 0.0,
    "advantage": "reward - group mean",
}


def train_rows(n: int, seed: int, env_name: str = ENV) -> list[dict]:
    """n train-split tasks as TRL dataset rows: the user turn, and the spec the verifier needs."""
    from envs import get_env

    env, rng = get_env(env_name), random.Random(seed)
    rows = []
    for _ in range(n):
        t = env.sample(rng, split="train")
        rows.append({"prompt": [{"role": "user", "content": t.prompt}], "spec": json.dumps(t.spec)})
    return rows


def reward_fn(env_name: str = ENV):
    """TRL reward function: the project's verifier on each completion's text (success 0/1)."""
    from envs import get_env

    env = get_env(env_name)

    def arith_success(prompts, completions, spec, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(env.verify(t, json.loads(s)).success) for t, s in zip(texts, spec)]

    return arith_success


def check_prompts(hf_tok, folder: Path, rows: list[dict]) -> None:
    """TRL renders the chat template itself: its prompt ids must be the ones asyncrl's workers get."""
    from envs.feeder import prompt_ids
    from policy import load_hf_tokenizer

    convs = [r["prompt"] for r in rows]
    theirs = hf_tok.apply_chat_template(
        conversation=convs, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ours = prompt_ids(load_hf_tokenizer(folder), [c[0]["content"] for c in convs], chat_template=True)
    if [list(x) for x in theirs] != ours:
        raise SystemExit(f"TRL's prompt ids differ from asyncrl's: {list(theirs[0])} vs {ours[0]}")


def wall_clock_saves(out: Path, every_s: float, budget_s: float):
    """A TrainerCallback: the training clock (save time excluded), a save at each mark, the stop."""
    from transformers import TrainerCallback

    class WallClockSaves(TrainerCallback):
        def __init__(self):
            self.t0, self.off, self.next_mark = None, 0.0, every_s
            self.saves: list[dict] = []
            self.steps: list[dict] = []

        def clock(self) -> float:
            return time.perf_counter() - self.t0 - self.off

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.steps.append(
                    {"step": state.global_step, "wall_s": self.clock(), "reward": logs["reward"]}
                )

        def on_step_end(self, args, state, control, model=None, **kw):
            t = self.clock()
            done = t >= budget_s or state.global_step >= state.max_steps
            if t >= self.next_mark or done:
                s0 = time.perf_counter()
                folder = out / "policies" / f"step{state.global_step:05d}"
                model.save_pretrained(folder)  # fp32: the weights TRL samples from
                self.off += time.perf_counter() - s0
                self.saves.append({"wall_s": round(t, 3), "step": state.global_step, "policy": str(folder)})
                self.next_mark = (int(t // every_s) + 1) * every_s
            if t >= budget_s:
                control.should_training_stop = True

    return WallClockSaves()


def lr_schedule(opt, warmup: int):
    """asyncrl's: lr·k/warmup at its k-th step (k = 1..warmup), then lr."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the HF folder (asyncrl model path smollm2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=15.0, help="training clock budget")
    ap.add_argument("--every-s", type=float, default=60.0, help="save the policy at these clock marks")
    ap.add_argument("--env", default=ENV, help="the task environment (its train split, its verifier)")
    ap.add_argument("--max-new-tokens", type=int, default=SETTINGS["max_new_tokens"])
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too (0: clock only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, out = Path(a.model), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    max_steps = a.max_steps or 100_000
    s = {**SETTINGS, "max_new_tokens": a.max_new_tokens}
    rows = train_rows(s["prompts_per_step"] * min(max_steps, 2_000), a.seed, a.env)
    tok = AutoTokenizer.from_pretrained(folder)
    check_prompts(tok, folder, rows[:16])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opt = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], betas=tuple(s["betas"]), weight_decay=0.0, fused=True
    )
    args = trl.GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=s["prompts_per_step"] * s["completions_per_prompt"],
        num_generations=s["completions_per_prompt"],
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=0,
        beta=s["kl"],
        scale_rewards="none",
        loss_type="dapo",
        learning_rate=s["lr"],
        max_grad_norm=s["grad_clip"],
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=a.seed,
        disable_tqdm=True,
    )
    saves = wall_clock_saves(out, a.every_s, a.minutes * 60)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_fn(a.env),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[saves],
        optimizers=(opt, lr_schedule(opt, s["warmup_steps"])),
    )
    trainer.train()
    result = {
        "side": "trl",
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "env": a.env,
        "settings": s,
        "minutes": a.minutes,
        "every_s": a.every_s,
        "steps": trainer.state.global_step,
        "train_s": round(saves.clock(), 3),
        "save_s": round(saves.off, 3),
        "policies": saves.saves,
        "step_rewards": saves.steps,
    }
    (out / "curve.json").write_text(json.dumps(result, indent=1))
    print(
        f"trl: {result['steps']} steps in {result['train_s']:.0f} s (+ {result['save_s']:.0f} s saving), "
        f"{len(saves.saves)} policies saved",
        flush=True,
    )
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
