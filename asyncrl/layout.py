"""[layout]: which of this node's devices each process of `asyncrl up` gets (the device plan).

    [layout]
    accelerator = "cuda"             # cuda | cpu
    devices = 8                      # the node's devices (0: count them: the GPUs `up` sees, or
                                     # the cores; on cpu a device is a slot: one rank or one engine)
    trainer_devices = [0, 1, 2, 3]   # the trainer group: one torchrun rank per device, FSDP2
                                     # (NCCL on cuda, gloo on cpu); one device: a plain process
    engine_devices = [4, 5, 6, 7]    # inference: one engine (rollout worker) per [worker.engine]
                                     # tensor_parallel_size of them, in order
    device_memory_gib = 0            # per device, for the trainer's fit (0: the smallest trainer
                                     # GPU's memory; cpu: the host's memory / ranks)

A device id is an index into the devices `up` itself sees (its CUDA_VISIBLE_DEVICES when set).
Each child is started with CUDA_VISIBLE_DEVICES = its devices ("" for the scorers and on a cpu
layout) and ASYNCRL_DEVICES = its share of the plan ("cuda:4,cuda:5"), which it logs at start
(policy/devices.py). An empty trainer_devices or engine_devices list leaves that role to other
nodes (the same run config, with --nats: docs/gpu.md). Without [layout], `up` runs as before.

    plan(conf, resolved) -> Plan | None     None without [layout]; ConfigError on a refusal:
        overlapping devices, too few devices (an id past `devices`, engines not a multiple of
        tensor_parallel_size, more devices than the node has), a process placed on the other
        accelerator, or a trainer step that does not fit its share by policy/memory.py's estimate
    Plan.lines()                           what `asyncrl config check` and `up` print
    Plan.apply(specs)                      `up`'s children placed: env, torchrun launch
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.model_refs import resolve as resolve_model_refs
from asyncrl.supervisor import ChildSpec
from asyncrl.thread_plan import available_cpus
from kernel.config import ConfigError
from policy import ModelConfig, load_tokenizer
from policy.hf import config_from_hf
from policy.memory import HEADROOM, memory_estimate, param_count

GiB = 2**30


@dataclass
class LayoutConfig:
    """The [layout] table, its keys and types checked before anything starts."""

    accelerator: str = "cuda"
    devices: int = 0
    trainer_devices: list = field(default_factory=list)
    engine_devices: list = field(default_factory=list)
    device_memory_gib: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> LayoutConfig:
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(
                f"[layout]: unknown key(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}"
            )
        for k, v in d.items():
            if k in ("trainer_devices", "engine_devices"):
                ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                want = "a list of device ids (integers)"
            elif k == "devices":
                ok, want = isinstance(v, int) and not isinstance(v, bool), "an integer"
            elif k == "device_memory_gib":
                ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
            else:
                ok, want = isinstance(v, str), "a string"
            if not ok:
                raise ConfigError(f"[layout] {k}: expected {want}, got {v!r}")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.accelerator not in ("cuda", "cpu"):
            raise ConfigError(f"[layout] accelerator must be 'cuda' or 'cpu', got {self.accelerator!r}")
        bad = [
            f"{k} = {getattr(self, k)!r}" for k in ("devices", "device_memory_gib") if getattr(self, k) < 0
        ]
        for k in ("trainer_devices", "engine_devices"):
            bad += [f"{k} = {getattr(self, k)!r}"] if any(x < 0 for x in getattr(self, k)) else []
        if bad:
            raise ConfigError("[layout]: out of range: " + ", ".join(bad))


@dataclass(frozen=True)
class Plan:
    accelerator: str
    devices: int
    trainer: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]
    visible: tuple[str, ...] = ()  # `up`'s own CUDA_VISIBLE_DEVICES entries (ids index these)
    memory: dict | None = None  # the trainer's fit: need, budget, parts, params (None: not checked)
    memory_note: str = ""  # why it was not checked

    @property
    def ranks(self) -> int:
        return len(self.trainer)

    @property
    def workers(self) -> int:
        return len(self.engines)

    def worker_count(self, flag: int | None) -> int:
        """The rollout workers: one per engine; a --workers that disagrees is refused."""
        if flag is not None and flag != self.workers:
            raise ConfigError(
                f"--workers {flag} disagrees with [layout] engine_devices: {self.workers} engine(s) "
                "(one worker per engine; leave --workers out)"
            )
        return self.workers

    def env(self, ids: tuple[int, ...]) -> dict[str, str]:
        """A child's device variables: its GPUs (none on cpu), and its share of the plan."""
        cuda = "" if self.accelerator == "cpu" else ",".join(self._physical(i) for i in ids)
        return {
            "CUDA_VISIBLE_DEVICES": cuda,
            "ASYNCRL_DEVICES": ",".join(f"{self.accelerator}:{i}" for i in ids),
        }

    def _physical(self, i: int) -> str:
        return self.visible[i] if self.visible else str(i)

    def trainer_env(self) -> dict[str, str]:
        return self.env(self.trainer)

    def trainer_launch(self) -> list[str]:
        """The argv between python and `-m trainer`: torchrun for a group, nothing for one rank.
        --standalone: a rendezvous on a free local port (several runs on one node do not meet)."""
        if self.ranks <= 1:
            return []
        return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.ranks}"]

    def apply(self, specs: list[ChildSpec]) -> list[ChildSpec]:
        """`up`'s children placed: the trainer group under torchrun on its devices, worker-i on
        engine i's, the scorers on no GPU. A role with no devices here has no child here."""
        out = []
        for s in specs:
            if s.component == "trainer":
                if not self.trainer:
                    continue
                s.env, s.launch = self.trainer_env(), self.trainer_launch()
            elif s.component == "rollout_worker":
                i = int(s.name.rsplit("-", 1)[1])
                s.env = self.env(self.engines[i])
                engine = s.conf.get("engine", {})
                if self.accelerator == "cuda" and engine.get("kind", "torch") == "torch":
                    s.conf = {**s.conf, "engine": {**engine, "device": "cuda"}}  # its one visible GPU
            else:
                s.env = {"CUDA_VISIBLE_DEVICES": "", "ASYNCRL_DEVICES": ""}
            out.append(s)
        return out

    def to_dict(self) -> dict:
        return {
            "accelerator": self.accelerator,
            "devices": self.devices,
            "trainer": list(self.trainer),
            "engines": [list(e) for e in self.engines],
            "trainer_env": self.trainer_env(),
            "engine_env": [self.env(e) for e in self.engines],
            "memory": self.memory,
            "memory_note": self.memory_note,
        }

    def lines(self) -> list[str]:
        acc = self.accelerator
        out = [f"device plan ([layout]): {self.devices} {acc} device(s)"]
        if self.trainer:
            how = (
                f"{self.ranks} ranks under torchrun, FSDP2 ({'nccl' if acc == 'cuda' else 'gloo'})"
                if self.ranks > 1
                else "1 process"
            )
            out.append(f"  trainer: {how} on {_ids(acc, self.trainer)}  {_env_line(self.trainer_env())}")
        else:
            out.append("  trainer: none on this node (another node runs it)")
        if self.engines:
            tp = len(self.engines[0])
            out.append(f"  engines: {self.workers} (tensor_parallel_size {tp})")
            out += [
                f"    worker-{i} on {_ids(acc, e)}  {_env_line(self.env(e))}"
                for i, e in enumerate(self.engines)
            ]
        else:
            out.append("  engines: none on this node (other nodes run the workers)")
        used = set(self.trainer) | {d for e in self.engines for d in e}
        idle = [i for i in range(self.devices) if i not in used]
        if idle:
            out.append(f"  unused: {_ids(acc, tuple(idle))}")
        out.append("  scorers: no device (CUDA_VISIBLE_DEVICES=)")
        if self.memory is not None:
            m = self.memory
            out.append(
                f"  trainer memory per device: ~{m['need'] / GiB:.1f} GiB of {m['budget'] / GiB:.1f} GiB "
                f"(a {_params(m['params'])}-parameter model over {self.ranks} rank(s); policy/memory.py "
                f"estimate, {HEADROOM:.0%} of a device may be used)"
            )
        elif self.memory_note:
            out.append(f"  trainer memory: not checked: {self.memory_note}")
        return out


def _ids(acc: str, ids: tuple[int, ...]) -> str:
    return ",".join(f"{acc}:{i}" for i in ids)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _env_line(env: dict) -> str:
    return f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}"


def visible_cuda(environ=None) -> tuple[tuple[str, ...], int]:
    """(`up`'s CUDA_VISIBLE_DEVICES entries or (), the number of GPUs it sees)."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        entries = tuple(x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",") if x.strip())
        return entries, len(entries)
    try:
        import torch

        return (), torch.cuda.device_count()
    except Exception:  # no CUDA build, no driver: nothing visible
        return (), 0


def trainer_model_config(tc) -> ModelConfig:
    """The model the trainer will build ([trainer.policy]), from its config alone (no weights)."""
    pol = resolve_model_refs({"init_checkpoint": tc.policy.init_checkpoint, "tokenizer": tc.policy.tokenizer})
    if pol["init_checkpoint"]:
        path = Path(pol["init_checkpoint"]) / "config.json"
        return config_from_hf(json.loads(path.read_text()))
    over = {k: v for k, v in tc.policy.model.items() if k != "preset"}
    vocab = over.pop("vocab_size", None) or load_tokenizer(pol["tokenizer"]).vocab_size
    return ModelConfig.preset(tc.policy.model.get("preset", "tiny"), vocab_size=vocab, **over)


def _host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def _budget(lc: LayoutConfig, trainer: tuple[int, ...]) -> tuple[int | None, str]:
    """Bytes one trainer device offers, and where that figure came from (or why there is none)."""
    if lc.device_memory_gib:
        return int(lc.device_memory_gib * GiB), "[layout] device_memory_gib"
    if lc.accelerator == "cpu":
        try:
            return _host_memory() // len(trainer), "host memory / ranks"
        except OSError as e:
            return None, str(e)
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device here; set [layout] device_memory_gib to check a plan for another machine"
    # the ids index the devices `up` sees, which is what torch numbers here too
    return min(torch.cuda.get_device_properties(i).total_memory for i in trainer), "the device"


def _fit(lc: LayoutConfig, resolved: dict, trainer: tuple[int, ...]) -> tuple[dict | None, str]:
    tc = resolved["trainer"]
    try:
        mcfg = trainer_model_config(tc)
        est = memory_estimate(
            mcfg,
            mcfg.n_layers,
            tc.loss.micro_batch_tokens,
            tc.loss.published_point,
            shards=len(trainer),
            reference=tc.loss.kl_coef > 0,
            logit_chunk_mb=tc.loss.logit_chunk_mb,
        )
    except (OSError, ValueError, KeyError) as e:  # an MLA model, an unprepared model:NAME, ...
        return None, f"no estimate for the trainer's model ({e})"
    budget, source = _budget(lc, trainer)
    if budget is None:
        return None, source
    m = {"need": est["total"], "budget": budget, "parts": est["parts"], "params": param_count(mcfg)}
    if est["total"] > HEADROOM * budget:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in est["parts"].items())
        raise ConfigError(
            "[layout] the model does not fit the trainer's share: a step needs "
            f"~{est['total'] / GiB:.1f} GiB per device on {len(trainer)} device(s) "
            f"(a {_params(m['params'])}-parameter model; "
            f"GiB by part: {parts}), a device has {budget / GiB:.1f} GiB ({source}; "
            f"{HEADROOM:.0%} usable): give trainer_devices more devices, or lower [trainer.loss] "
            "micro_batch_tokens"
        )
    return m, ""


def plan(conf: dict, resolved: dict, environ=None) -> Plan | None:
    """The device plan of a run config ([layout]; None without one), or ConfigError naming the
    problem. `resolved`: config_check.resolve(conf), the typed config of every process."""
    raw = conf.get("layout")
    if raw is None:
        return None
    lc = LayoutConfig.from_dict(raw)
    trainer, engine = tuple(lc.trainer_devices), tuple(lc.engine_devices)
    visible: tuple[str, ...] = ()
    if lc.accelerator == "cuda":
        visible, here = visible_cuda(environ)
        if lc.devices == 0 and here == 0:
            raise ConfigError(
                "[layout] too few devices: no CUDA device visible here (set devices = N to check a "
                "plan for another machine)"
            )
        if here and lc.devices > here:
            raise ConfigError(
                f"[layout] too few devices: devices = {lc.devices}, this node has {here} visible"
            )
        devices = lc.devices or here
    else:
        devices = lc.devices or available_cpus()
    if not trainer and not engine:
        raise ConfigError("[layout] places nothing: give trainer_devices and/or engine_devices")
    for name, ids in (("trainer_devices", trainer), ("engine_devices", engine)):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ConfigError(f"[layout] overlap: {name} lists device(s) {twice} more than once")
    both = sorted(set(trainer) & set(engine))
    if both:
        raise ConfigError(
            f"[layout] overlap: device(s) {both} are in both trainer_devices and engine_devices "
            "(the trainer and an engine may not share a device)"
        )
    past = sorted(i for i in trainer + engine if i >= devices)
    if past:
        raise ConfigError(
            f"[layout] too few devices: device id(s) {past} but devices = {devices} (ids 0..{devices - 1})"
        )
    we = resolved["worker"].engine
    tp = we.tensor_parallel_size
    if tp > 1 and lc.accelerator == "cpu":
        raise ConfigError("[worker.engine] tensor_parallel_size > 1 needs [layout] accelerator = 'cuda'")
    if len(engine) % tp:
        raise ConfigError(
            f"[layout] too few devices: {len(engine)} engine device(s) is not a multiple of "
            f"[worker.engine] tensor_parallel_size = {tp}"
        )
    _check_placement(conf, lc.accelerator)
    up = conf.get("up", {})
    if up.get("trainers", 1) > 1:
        raise ConfigError(
            "[up] trainers > 1 with a [layout]: a standby trainer group needs devices of its own"
        )
    engines = tuple(engine[i : i + tp] for i in range(0, len(engine), tp))
    if "workers" in up and up["workers"] != len(engines):
        raise ConfigError(
            f"[up] workers = {up['workers']} disagrees with [layout] engine_devices: {len(engines)} "
            f"engine(s) of tensor_parallel_size {tp} (one worker per engine; leave [up] workers out)"
        )
    memory, note = _fit(lc, resolved, trainer) if trainer else (None, "")
    return Plan(lc.accelerator, devices, trainer, engines, visible, memory, note)


def _check_placement(conf: dict, acc: str) -> None:
    """A device key of a process that the layout contradicts (the layout places the processes)."""
    t = ((conf.get("trainer") or {}).get("policy") or {}).get("device", "auto")
    e = ((conf.get("worker") or {}).get("engine") or {}).get("device")
    if acc == "cuda" and t == "cpu":
        raise ConfigError("[trainer.policy] device = 'cpu' but [layout] accelerator = 'cuda'")
    if acc == "cpu" and str(t).startswith("cuda"):
        raise ConfigError(f"[trainer.policy] device = {t!r} but [layout] accelerator = 'cpu'")
    if e is not None and acc == "cuda" and e != "cuda":
        raise ConfigError(
            f"[worker.engine] device = {e!r}: under a cuda [layout] each engine sees only its own "
            "devices; leave device out (or 'cuda')"
        )
    if e is not None and acc == "cpu" and e != "cpu":
        raise ConfigError(f"[worker.engine] device = {e!r} but [layout] accelerator = 'cpu'")
