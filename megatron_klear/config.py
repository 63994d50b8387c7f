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
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_klear.models.builder import ModelOptions
from megatron_klear.rewards.config import RewardConfig
from megatron_klear.platform.distributed import ParallelConfig


class ConfigError(ValueError):
    pass


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

    def validate(self):
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
class RLConfig:
    """GPPO and the rest of the Klear RL recipe (KLEAR-REASONER.md sections 3-4)."""

    algo: str = "gppo"  # gppo | clip_higher | ppo | cispo
    eps_low: float | None = None  # None: the algorithm's default (gppo: 0.2)
    eps_high: float | None = None  # None: the algorithm's default (gppo: 0.28)
    dual_clip: float | None = 10.0
    beta1: float = 1.0  # CE-GPPO: 0.25-0.75 against entropy collapse; 1.0 is plain GPPO
    beta2: float = 1.0
    agg: str = "token_mean"  # token_mean (the paper's 1/sum T) | seq_mean_token_mean | seq_mean_token_sum_norm
    norm_constant: float | None = None  # seq_mean_token_sum_norm's fixed length
    nll_coef: float = 0.1  # alpha: NLL on solved rollouts (math answer right / every test passed)
    kl_coef: float = 0.0  # must stay 0: no reference-model KL term (the recipe has none); non-zero is refused
    prompts_per_step: int = 128
    responses_per_prompt: int = 8
    mini_batch_prompts: int = 16  # 128/16 = 8 optimizer steps per rollout batch
    max_tokens_per_micro_batch: int = 32768  # packing budget per micro-batch (not a sample count)
    temperature: float = 1.0  # must equal the rollout engine's sampling temperature
    tis_cap: float | None = None  # truncated importance sampling for rollout/train mismatch (off)
    prompts: list = field(default_factory=list)  # RL prompt JSONL files (see data/prompts.py)
    max_prompt_length: int = 4096  # longer prompts are left-truncated
    oversample_prompts: int = 0  # generate for this many prompts, keep prompts_per_step after filtering (0: no oversampling)
    # Dynamic sampling (DAPO): while fewer than prompts_per_step groups survive the filters, generate
    # another batch (of oversample_prompts or prompts_per_step prompts), up to this many batches per
    # step; then on_shortfall decides: train (on the groups there are, logged) or fail. The authors'
    # trainer: 1 batch, fail.
    max_generation_batches: int = 1
    on_shortfall: str = "train"  # train | fail
    on_bad_line: str = "fail"  # fail | skip (bad prompt lines)
    std_normalize: bool = True  # False: Dr.GRPO advantages (no division by the std)
    filter_zero_spread: bool = True
    overlong_filter: bool = False

    def validate(self):
        from megatron_klear.rl.losses import AGGREGATIONS, ALGORITHMS

        if self.algo not in ALGORITHMS:
            raise ConfigError(f"rl.algo must be one of {ALGORITHMS}, got {self.algo!r}")
        if self.agg not in AGGREGATIONS:
            raise ConfigError(f"rl.agg must be one of {AGGREGATIONS}, got {self.agg!r}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"rl.dual_clip must be > 1 (or null), got {self.dual_clip}")
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ConfigError(
                f"rl.prompts_per_step={self.prompts_per_step} must be a multiple of "
                f"rl.mini_batch_prompts={self.mini_batch_prompts}"
            )
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError("rl.tis_cap must be > 0 (or null)")
        if self.kl_coef != 0:
            raise ConfigError(f"rl.kl_coef={self.kl_coef}: a reference-model KL term is not implemented (the "
                              "Klear recipe uses none: no KL, no reference model); set rl.kl_coef=0")
        if self.oversample_prompts and self.oversample_prompts < self.prompts_per_step:
            raise ConfigError(f"rl.oversample_prompts={self.oversample_prompts} must be >= rl.prompts_per_step="
                              f"{self.prompts_per_step} (or 0: no oversampling)")
        if self.max_generation_batches < 1:
            raise ConfigError(f"rl.max_generation_batches must be >= 1, got {self.max_generation_batches}")
        if self.on_shortfall not in ("train", "fail"):
            raise ConfigError(f"rl.on_shortfall must be train or fail, got {self.on_shortfall!r}")
        if self.temperature <= 0:
            raise ConfigError("rl.temperature must be > 0")


@dataclass
class RolloutConfig:
    """Where responses come from. Sampling temperature is rl.temperature (one value for the engine
    and for the trainer's log-prob recompute).

    ``engine=http``: SGLang servers, directly or behind sglang-router (``urls``). Generation is sent as
    concurrent requests (one per prompt with ``n`` samples, or one per sample), at most
    ``max_concurrent_requests`` in flight; weight updates go to every worker (``workers``, or the
    router's ``GET /workers``), never to the router."""

    engine: str = "embedded"  # embedded (torch, in the driver process) | http (SGLang servers / sglang-router)
    urls: list = field(default_factory=list)  # http: where /generate goes: one sglang-router, or the servers
    workers: list = field(default_factory=list)  # http: the servers for weight updates (default: asked from the router)
    max_new_tokens: int = 32768
    top_p: float = 1.0
    top_k: int = -1
    dtype: str = "fp32"  # embedded engine dtype
    sync_dir: str = ""  # http: shared directory for weight updates from disk (default <save_dir>/weights)
    generate_timeout_s: float = 3600.0  # one /generate request (one prompt's samples)
    control_timeout_s: float = 60.0  # health, info, pause/continue
    weight_update_timeout_s: float = 1800.0  # one server's reload of the weights
    max_concurrent_requests: int = 512  # /generate requests in flight
    request_granularity: str = "prompt"  # prompt (one request per prompt, n samples) | sample (one per sample)
    max_retries: int = 2  # per request, after a transport error, a 5xx or an abort
    health_check_interval_s: float = 10.0  # probe every worker's /health this often while generating
    health_check_timeout_s: float = 10.0
    health_failure_threshold: int = 3  # missed probes in a row before the step fails naming the worker
    send_seed: bool = False  # send sampling_seed (SGLang honours it only with --enable-deterministic-inference)
    chunk_prompts: int = 0  # embedded engine: prompts per generate call, graded while the next runs (0: one call)
    # http: how weights reach the servers. distributed: SGLang's update_weights_from_distributed, a
    # bucketed broadcast from each pipeline stage's leader over a process group with every server
    # (rollout/weight_sync.py); disk: a versioned HF directory in sync_dir that every server reloads.
    # auto: distributed, or disk with colocate (NCCL cannot pair the trainer's rank with a server on its own GPU).
    weight_sync: str = "auto"  # auto | distributed | disk
    sync_bucket_mb: float = 1024.0  # distributed: tensors per broadcast (one dtype per bucket)
    sync_backend: str = "auto"  # distributed: auto (nccl on GPU, gloo on CPU) | nccl | gloo
    sync_master_addr: str = ""  # distributed: the address servers reach the stage leaders at ("": the interface routing to the first server)
    sync_master_port: int = 0  # distributed: stage s hosts its group's TCP store at this port + s (0: a free port)
    sync_group_timeout_s: float = 120.0  # distributed: creating the group with every server
    sync_bucket_timeout_s: float = 300.0  # distributed: one bucket's broadcast (and the servers' answer)
    # Probe check: the servers' log-probs of a fixed greedy probe must equal the trainer's (within a
    # dtype-aware tolerance) after the first sync, after a resume, and every verify_interval steps
    # (0: only those two; -1: never); verify_tolerance 0: by dtype (rl/verify.py).
    verify_interval: int = 10
    verify_tolerance: float = 0.0
    # MoE models: the trainer's old-log-prob pass routes each token to the experts the engine chose
    # (Megatron-Core's RouterReplay), so that routing differences do not enter the old log-probs.
    # The embedded engine records them; SGLang servers return them when started with
    # --enable-return-routed-experts (return_routed_experts). Any TP/SP/PP/CP/EP layout.
    router_replay: bool = False
    # http: the SGLang servers share the trainer's GPUs (started with --enable-memory-saver): they
    # release their KV cache, weights and CUDA graphs (/release_memory_occupation) before the trainer
    # builds its state and before every update; each sync resumes their weights, reloads them from
    # disk, then resumes the rest. Needs weight_sync=disk (auto picks it).
    colocate: bool = False
    # colocate: the trainer frees its gradient buffers and moves its optimizer state to host memory
    # from each sync until the next update, while the servers hold theirs (training/offload.py)
    offload_trainer: bool = True

    def validate(self):
        if self.engine not in ("embedded", "http"):
            raise ConfigError(f"rollout.engine must be embedded or http, got {self.engine!r}")
        if self.engine == "http" and not self.urls:
            raise ConfigError("rollout.engine=http needs rollout.urls (SGLang server or router URLs)")
        if self.max_new_tokens < 1:
            raise ConfigError("rollout.max_new_tokens must be >= 1")
        if self.request_granularity not in ("prompt", "sample"):
            raise ConfigError(f"rollout.request_granularity must be prompt or sample, got {self.request_granularity!r}")
        if self.max_concurrent_requests < 1 or self.health_failure_threshold < 1 or self.max_retries < 0:
            raise ConfigError("rollout: max_concurrent_requests and health_failure_threshold must be >= 1, "
                              "max_retries >= 0")
        for key in ("generate_timeout_s", "control_timeout_s", "weight_update_timeout_s", "health_check_interval_s",
                    "health_check_timeout_s", "sync_bucket_mb", "sync_group_timeout_s", "sync_bucket_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"rollout.{key} must be > 0, got {getattr(self, key)}")
        if self.weight_sync not in ("auto", "distributed", "disk"):
            raise ConfigError(f"rollout.weight_sync must be auto, distributed or disk, got {self.weight_sync!r}")
        if self.colocate and self.engine != "http":
            raise ConfigError("rollout.colocate is for SGLang servers on the trainer's GPUs (rollout.engine=http); the "
                              "embedded engine already runs inside the trainer's driver process")
        if self.colocate and self.weight_sync == "distributed":
            raise ConfigError("rollout.colocate with rollout.weight_sync=distributed: a server on the trainer's own GPU "
                              "cannot join the trainer's NCCL group (NCCL refuses two ranks of one group on one "
                              "device); use rollout.weight_sync=disk (or auto)")
        if self.weight_sync == "auto":
            self.weight_sync = "disk" if self.colocate else "distributed"
        if self.sync_backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"rollout.sync_backend must be auto, nccl or gloo, got {self.sync_backend!r}")
        if not 0 <= self.sync_master_port < 65536:
            raise ConfigError(f"rollout.sync_master_port must be a port number (0: a free one), got {self.sync_master_port}")

        if self.verify_interval < -1 or self.verify_tolerance < 0:
            raise ConfigError("rollout.verify_interval must be >= -1 and rollout.verify_tolerance >= 0")


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
            raise ConfigError("rl.agg=seq_mean_token_mean is not supported with parallel.cp > 1 "
                              "(use token_mean or seq_mean_token_sum_norm)")
        if p.vpp and p.vpp > 1 and self.data.micro_batches_per_step % p.pp:
            raise ConfigError(
                f"data.micro_batches_per_step={self.data.micro_batches_per_step} must be a multiple of "
                f"parallel.pp={p.pp} with the interleaved schedule (parallel.vpp={p.vpp})")
        if self.optim.schedule_unit == "rl_step" and not self.rl.prompts:
            raise ConfigError("optim.schedule_unit=rl_step is for RL jobs (rl.prompts); SFT schedules by optimizer_step")
        longest = self.rl.max_prompt_length + self.rollout.max_new_tokens
        if self.rl.prompts and self.rl.max_tokens_per_micro_batch < longest:
            raise ConfigError(
                f"rl.max_tokens_per_micro_batch={self.rl.max_tokens_per_micro_batch} cannot hold the longest "
                f"sample: rl.max_prompt_length + rollout.max_new_tokens = {longest}")

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
            candidate = ".".join([section] + parts[i + 1:])
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


def _set(obj, dotted: str, value, where: str) -> None:
    parts = dotted.split(".")
    target = obj
    for i, name in enumerate(parts):
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"{where}: '{'.'.join(parts[:i])}' is not a section")
        names = [f.name for f in dataclasses.fields(target)]
        if name not in names:
            hint = _suggest(obj, parts, i, names)
            raise ConfigError(
                f"{where}: unknown key '{dotted}'" + (f" (did you mean '{hint}'?)" if hint else "")
            )
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
    """Build and validate a config: defaults, then the YAML file, then ``key=value`` overrides."""
    cfg = cls()
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                root = yaml.compose(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else path
            raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
        if root is not None:
            if not isinstance(root, yaml.MappingNode):
                raise ConfigError(f"{path}: the top level must be a mapping of sections")
            items: list = []
            _walk_yaml(root, "", path, items)
            for key, value, where in items:
                _set(cfg, key, value, where)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"command line: override '{item}' is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        _set(cfg, key.strip(), yaml.safe_load(raw) if raw != "" else "", "command line")
    return cfg.validate()


def dump_config(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
