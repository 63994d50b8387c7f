"""One configuration schema for every job: YAML in, ``key.sub=value`` overrides, validated at start.

A job config is a :class:`JobConfig` of sections (model, parallel, optim, data, train, logging,
and for RL: rl, rollout, reward). Unknown keys and ill-typed values are errors that name the key
and, for YAML, the file and line::

    config.yaml:12: unknown key 'optim.lr_warmup' (did you mean 'optim.warmup_steps'?)

Overrides on the command line use dotted keys: ``optim.lr=1e-5 parallel.tp=2 data.paths=[a,b]``
(values are parsed as YAML scalars / flow lists).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_klear.models.builder import ModelOptions
from megatron_klear.platform.distributed import ParallelConfig
from megatron_klear.platform.errors import ConfigError
from megatron_klear.rewards.config import RewardConfig
from megatron_klear.rl.config import RLConfig
from megatron_klear.rl.losses import loss_spec
from megatron_klear.rollout.config import RolloutConfig

__all__ = ["ConfigError", "JobConfig", "RLConfig", "RolloutConfig", "RewardConfig", "dump_config", "load_config"]


@dataclass
class ModelConfig(ModelOptions):
    """``path``: an HF checkpoint directory or a converted torch_dist directory to start from."""

    path: str = ""


@dataclass
class OptimConfig:
    lr: float = 8e-5  # paper SFT: 8e-5 cosine-decayed to 4e-5
    min_lr: float = 4e-5
    decay_style: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0  # linear from lr 0, in schedule_unit steps
    decay_steps: int | None = None  # default: train.steps (in schedule_unit steps)
    # The unit of warmup_steps / decay_steps: the schedule advances once per optimizer step
    # (Megatron; SFT) or once per RL step (the authors' verl trainer: "10 warm-up steps" = 10 RL
    # steps = 80 optimizer steps at 8 mini-batches per step). rl_step is for RL jobs only.
    schedule_unit: str = "optimizer_step"  # optimizer_step | rl_step
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95  # Megatron's default; the authors' RL (verl's AdamW) uses 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = False
    # The distributed optimizer's checkpoint format. false: Megatron-Core's dp_reshardable (each rank
    # writes its own shard, no gather; a resume may change only the data-parallel size). true:
    # fully_reshardable (the state gathered per parameter on each data-parallel group's first rank,
    # over gloo, into CPU memory; a resume may change TP, PP and DP). Megatron-LM's
    # --dist-ckpt-optim-fully-reshardable with --distrib-optim-fully-reshardable-mem-efficient.
    reshardable_checkpoints: bool = False

    def validate(self):
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"optim.decay_style must be cosine, linear or constant, got {self.decay_style!r}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim: need 0 <= min_lr <= lr and lr > 0 (lr={self.lr}, min_lr={self.min_lr})")
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps must be >= 0")
        if self.schedule_unit not in ("optimizer_step", "rl_step"):
            raise ConfigError(f"optim.schedule_unit must be optimizer_step or rl_step, got {self.schedule_unit!r}")


@dataclass
class DataConfig:
    """SFT data: the prefix written by tools/preprocess_sft.py."""

    prefix: str = ""
    seq_length: int = 32768
    micro_batches_per_step: int = 1  # packed rows per DP rank per optimizer step
    pad_to_multiple: int = 0  # 0: from the layout and FP8 recipe (training.batches.padding_rule); else a multiple of it
    segment_multiple: int = 0  # pack examples as if rounded up to this; 0: 2*cp with context parallelism, else 1
    seed: int = 1234
    remainder: str = "pad"  # pad | drop (the last, partial step of an epoch)

    def validate(self):
        if self.remainder not in ("pad", "drop"):
            raise ConfigError(f"data.remainder must be pad or drop, got {self.remainder!r}")
        if self.seq_length <= 0 or self.micro_batches_per_step <= 0:
            raise ConfigError("data.seq_length and data.micro_batches_per_step must be positive")


@dataclass
class TrainConfig:
    steps: int = 0  # optimizer steps; 0 = derive from epochs
    epochs: int = 4  # paper SFT: 4 epochs
    seed: int = 1234
    save_dir: str = ""
    save_interval: int = 0  # steps between checkpoints (0: only at the end and on SIGTERM)
    keep_last: int = 3
    resume: bool = True  # continue from save_dir's latest checkpoint when there is one
    overwrite: bool = False  # start fresh even if save_dir holds a run: move that run to save_dir/replaced/<time>/
    log_interval: int = 1
    logprob_chunk_size: int = 4096  # tokens per chunk of the vocab-parallel log-prob
    logprobs_from_hidden: bool = True  # never materialise [tokens, vocab/TP] logits (models/output_head.py)
    # fp16's dynamic loss scale to start from (null: 2^16 for RL, as NeMo-RL and slime start fp16;
    # Megatron-Core's 2^32 for SFT). From 2^32 an RL run's first ~17 steps -- each a whole rollout --
    # overflow and are skipped while the scale halves (hysteresis 2 absorbs only the first overflow).
    initial_loss_scale: float | None = None

    def validate(self):
        if self.initial_loss_scale is not None and not self.initial_loss_scale >= 1:
            raise ConfigError(f"train.initial_loss_scale must be >= 1 (or null), got {self.initial_loss_scale}")
        if self.steps < 0 or self.epochs < 0 or (self.steps == 0 and self.epochs == 0):
            raise ConfigError("train: set train.steps > 0 or train.epochs > 0")
        if self.keep_last < 1:
            raise ConfigError("train.keep_last must be >= 1")


@dataclass
class LoggingConfig:
    jsonl: str = ""  # default: <save_dir>/metrics.jsonl
    wandb: bool = False  # offline unless WANDB_API_KEY is set
    wandb_project: str = "megatron-klear"
    run_name: str = ""
    tensorboard: bool = False  # writes to <save_dir>/tensorboard


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def validate(self):
        if self.rollout.pause_mode == "auto":  # requests in flight survive a push in asynchronous RL
            self.rollout.pause_mode = "retract" if self.rl.async_steps else "abort"
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                try:
                    section.validate()
                except ConfigError:
                    raise
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        self._validate_across_sections()
        return self

    def _validate_across_sections(self):
        p = self.parallel
        if p.cp > 1 and self.rl.agg == "seq_mean_token_mean":
            # each CP rank sees only part of every sequence, so per-sequence means are not local
            raise ConfigError(
                "rl.agg=seq_mean_token_mean is not supported with parallel.cp > 1 "
                "(use token_mean or seq_mean_token_sum_norm)"
            )
        rl = self.rl
        per_sequence = {
            f"rl.algo={rl.algo}": loss_spec(rl.algo).sequence_level,
            "rl.is_level=sequence": rl.tis_cap is not None and rl.is_level == "sequence",
            f"rl.is_reject={rl.is_reject}": rl.is_reject in ("sequence", "geometric"),
        }
        for setting, on in per_sequence.items():
            if p.cp > 1 and on:  # a sequence ratio needs every token of the sequence on one rank
                raise ConfigError(
                    f"{setting} takes a ratio over whole sequences and is not supported with parallel.cp > 1 "
                    "(use parallel.cp=1, with more tensor parallelism for long responses)"
                )
        if p.vpp and p.vpp > 1 and self.data.micro_batches_per_step % p.pp:
            raise ConfigError(
                f"data.micro_batches_per_step={self.data.micro_batches_per_step} must be a multiple of "
                f"parallel.pp={p.pp} with the interleaved schedule (parallel.vpp={p.vpp})"
            )
        if self.optim.schedule_unit == "rl_step" and not self.rl.prompts:
            raise ConfigError(
                "optim.schedule_unit=rl_step is for RL jobs (rl.prompts); SFT schedules by optimizer_step"
            )
        asynchronous = [
            k for k, on in (("rl.async_steps", self.rl.async_steps), ("rollout.partial", self.rollout.partial)) if on
        ]
        if asynchronous and not self.rollout.servers:
            raise ConfigError(
                f"{' and '.join(asynchronous)} need rollout servers that abort and continue requests while "
                "the trainer runs: set rollout.engine=sglang (SGLang, or the stand-in server of "
                "megatron_klear.rollout.sglang_standin on CPU) or rollout.engine=vllm"
            )
        if self.rl.async_steps and self.rollout.colocate:
            raise ConfigError(
                "rl.async_steps with rollout.colocate: colocated servers share the trainer's GPUs and "
                "release their memory while it trains, so nothing can generate meanwhile; give the "
                "servers their own GPUs (rollout.colocate=false) or set rl.async_steps=0"
            )
        if self.rl.prompts:
            self._validate_rl_numerics()
            if p.vpp and p.vpp > 1:
                # no RL test has ever run the interleaved schedule: a PP=2 x VPP=2 actor update of
                # packed rows hung on the CPU (2026-12-06), so it is refused until it is made to work
                raise ConfigError(
                    f"parallel.vpp={p.vpp} in an RL job: the actor's update does not run under the interleaved "
                    "pipeline schedule yet; use parallel.vpp=1 (plain 1F1B over parallel.pp stages)"
                )
        longest = self.rl.max_prompt_length + self.rollout.max_new_tokens
        if self.rl.prompts and self.rl.max_tokens_per_micro_batch < longest:
            raise ConfigError(
                f"rl.max_tokens_per_micro_batch={self.rl.max_tokens_per_micro_batch} cannot hold the longest "
                f"sample: rl.max_prompt_length + rollout.max_new_tokens = {longest}"
            )

    def _validate_rl_numerics(self):
        """What makes the trainer's log-probs something other than the policy the loss assumes."""
        m, rl = self.model, self.rl
        dropout = [f"model.{k}={getattr(m, k)}" for k in ("hidden_dropout", "attention_dropout") if getattr(m, k)]
        if dropout:
            # the proximal policy (old log-probs) must be a function of the weights: the first
            # mini-batch reuses its own forward for them, and with dropout every forward is another policy
            raise ConfigError(
                f"{' and '.join(dropout)} in an RL job: with dropout every forward samples a different policy, "
                "so the old log-probs (the first mini-batch reuses its own forward) and the engine's are not the "
                "policy being updated; set them to 0 (Qwen3 is trained without dropout)"
            )
        if m.fp8 and not rl.correction.active:
            raise ConfigError(
                f"model.fp8={m.fp8} in an RL job without an importance correction: the trainer's FP8 forward "
                "(old log-probs, update, probe) differs from the engine's bf16 rollouts by more than bf16 "
                "numerics, and nothing corrects it; set rl.tis_cap (2 is common) or rl.is_reject "
                "(docs/gppo.md, FP8 in RL), or train in bf16 (model.fp8=null)"
            )

    def to_yaml(self) -> str:
        return dump_config(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- loading -----------------------------------------------------------------------------------
def _type_ok(value, tp) -> tuple[bool, Any]:
    """Check/coerce ``value`` against annotation ``tp``; returns (ok, value)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return True, None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            ok, v = _type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is Any:
        return True, value
    if origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            return True, list(value)
        return False, value
    if origin is dict:
        return isinstance(value, dict), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is str:
        return isinstance(value, str), value
    return True, value


def _resolve_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _keys(obj, prefix: str = "") -> list:
    """Every settable dotted key below ``obj``."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out += _keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


def _suggest(obj, parts: list, i: int, names: list) -> str | None:
    """A close match for the unknown ``parts[i]``: a misspelt section with the rest kept
    (``trian.steps`` -> ``train.steps``), a misspelt key among its siblings (``optim.lr_warmup``
    -> ``optim.warmup_steps``), else the closest key anywhere."""
    dotted = ".".join(parts)
    everything = _keys(obj)
    if i < len(parts) - 1:  # a section name
        for name in difflib.get_close_matches(parts[i], names, n=3, cutoff=0.6):
            section = ".".join(parts[:i] + [name])
            candidate = ".".join([section] + parts[i + 1 :])
            if candidate in everything:
                return candidate
            inside = difflib.get_close_matches(candidate, [k for k in everything if k.startswith(section + ".")], n=1)
            if inside:
                return inside[0]
    else:
        prefix = ".".join(parts[:i])
        hint = difflib.get_close_matches(dotted, [f"{prefix}.{n}" if prefix else n for n in names], n=1)
        if hint:
            return hint[0]
    hint = difflib.get_close_matches(dotted, everything, n=1)
    return hint[0] if hint else None


#: Keys other RL stacks have that this one refuses by name (a "did you mean" would mislead), and why.
REMOVED_KEYS = {
    "rl.kl_coef": "there is no reference-model KL term (the Klear recipe trains with none and keeps no "
    "reference model; docs/gppo.md#no-kl); remove the key",
}


def _set(obj, dotted: str, value, where: str) -> None:
    parts = dotted.split(".")
    target = obj
    for i, name in enumerate(parts):
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"{where}: '{'.'.join(parts[:i])}' is not a section")
        names = [f.name for f in dataclasses.fields(target)]
        if name not in names:
            if dotted in REMOVED_KEYS:
                raise ConfigError(f"{where}: '{dotted}' is not a key: {REMOVED_KEYS[dotted]}")
            hint = _suggest(obj, parts, i, names)
            raise ConfigError(f"{where}: unknown key '{dotted}'" + (f" (did you mean '{hint}'?)" if hint else ""))
        if i == len(parts) - 1:
            tp = _resolve_hints(type(target))[name]
            ok, coerced = _type_ok(value, tp)
            if not ok:
                tname = getattr(tp, "__name__", str(tp))
                raise ConfigError(f"{where}: key '{dotted}' expects {tname}, got {value!r}")
            setattr(target, name, coerced)
        else:
            target = getattr(target, name)


def _walk_yaml(node, prefix: str, path: str, out: list) -> None:
    """Flatten a YAML mapping node into (dotted key, value, 'file:line')."""
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        line = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode) and not key_node.value.endswith("_kwargs"):
            _walk_yaml(value_node, key + ".", path, out)
        else:
            out.append((key, yaml.safe_load(yaml.serialize(value_node)), f"{path}:{line}"))


def load_config(path: str | None = None, overrides: list[str] | None = None, cls=JobConfig):
    """Build and validate a config: defaults, then the YAML file, then ``key=value`` overrides.

    A file may start from another one: a top-level ``base: <path>`` (relative to the file) is read
    first, then the file's own keys on top (a variant config holds only what it changes)."""
    cfg = cls()
    for key, value, where in _yaml_items(path, ()) if path else ():
        _set(cfg, key, value, where)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"command line: override '{item}' is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        _set(cfg, key.strip(), yaml.safe_load(raw) if raw != "" else "", "command line")
    return cfg.validate()


def _yaml_items(path: str, seen: tuple) -> list:
    """``(key, value, where)`` of a YAML config file, its ``base`` chain first."""
    if os.path.abspath(path) in seen:
        raise ConfigError(f"{path}: 'base' makes a cycle: {' -> '.join(seen + (os.path.abspath(path),))}")
    try:
        with open(path, encoding="utf-8") as f:
            root = yaml.compose(f)
    except FileNotFoundError:
        where = f" (the base of {seen[-1]})" if seen else ""
        raise ConfigError(f"config file not found: {path}{where}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if root is None:
        return []
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    items: list = []
    for k, v in list(root.value):
        if k.value == "base":
            if not isinstance(v, yaml.ScalarNode) or not v.value:
                raise ConfigError(f"{path}:{k.start_mark.line + 1}: base must be a path to a config file")
            base = os.path.join(os.path.dirname(os.path.abspath(path)), v.value)
            items += _yaml_items(base, seen + (os.path.abspath(path),))
            root.value.remove((k, v))
    _walk_yaml(root, "", path, items)
    return items


def dump_config(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
