"""The ``rl`` section of a job config: the GPPO objective, the batch shape of an RL step, dynamic
sampling and the prompt data (validated at start; errors name the key)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_klear.platform.errors import ConfigError
from megatron_klear.rl.importance import Correction
from megatron_klear.rl.losses import AGGREGATIONS, POLICY_LOSSES, LossSettings, loss_names


@dataclass
class RLConfig:
    """GPPO and the rest of the Klear RL recipe (docs/recipe.md, docs/gppo.md)."""

    algo: str = "gppo"  # a loss of rl/losses.py's table, POLICY_LOSSES: gppo | clip_higher | ppo | cispo | ...
    eps_low: float | None = None  # None: the algorithm's default (gppo: 0.2)
    eps_high: float | None = None  # None: the algorithm's default (gppo: 0.28)
    dual_clip: float | None = 10.0
    beta1: float = 1.0  # CE-GPPO: 0.25-0.75 against entropy collapse; 1.0 is plain GPPO
    beta2: float = 1.0
    agg: str = "token_mean"  # token_mean (the paper's 1/sum T) | seq_mean_token_mean | seq_mean_token_sum_norm
    norm_constant: float | None = None  # seq_mean_token_sum_norm's fixed length
    nll_coef: float = 0.1  # alpha: NLL on solved rollouts (math answer right / every test passed)
    prompts_per_step: int = 128
    responses_per_prompt: int = 8
    mini_batch_prompts: int = 16  # 128/16 = 8 optimizer steps per rollout batch
    max_tokens_per_micro_batch: int = 32768  # packing budget per micro-batch (not a sample count)
    temperature: float = 1.0  # must equal the rollout engine's sampling temperature
    # Truncated importance sampling: each token's advantage is weighted by min(pi_prox / pi_behav,
    # tis_cap), pi_behav = the engine's log-prob of the version that sampled it, pi_prox = the
    # trainer's recomputed one (AReaL's decoupled objective; covers engine/trainer numerics and stale
    # tokens of asynchronous or partial rollouts). None: off. Refused with dppo_*, whose ratio is
    # already against the engine's log-probs.
    tis_cap: float | None = None
    # token: the weight per token (above); sequence: min(prod_t pi_prox / pi_behav, tis_cap) on every
    # token of the sequence (verl's sequence-level IS)
    is_level: str = "token"
    # Rejection of tokens or sequences whose engine/trainer ratio is outside [is_reject_low,
    # is_reject_high] (weight 0; rl/importance.py): token | sequence (the product) | geometric (its
    # per-token geometric mean) | null. is_reject_low defaults to 1 / is_reject_high. Kept tokens
    # weigh 1, or their ratio with tis_cap = is_reject_high (IcePop: token, 0.5 / 5, tis_cap 5).
    is_reject: str | None = None
    is_reject_low: float | None = None
    is_reject_high: float | None = None
    # Asynchronous GPPO (docs/async.md): the next batch generates while the actor trains on this one
    # (0: today's synchronous loop; 1: one step ahead). Needs rollout servers (rollout.engine=sglang).
    async_steps: int = 0
    # A response holding a token more than this many weight versions older than the trainer's policy is
    # regenerated from scratch (counted: rollout/stale_regenerated). Must be >= async_steps.
    max_staleness: int = 1
    # Drop tokens of an older weight version than the trainer's from the loss (slime's choice), instead
    # of weighting them by tis_cap (AReaL's).
    mask_stale_tokens: bool = False
    prompts: list = field(default_factory=list)  # RL prompt files (see data/prompts.py, docs/data.md)
    # how rl.prompts are read: auto (detected per file, logged) | project | verl | livecodebench | math
    prompts_format: str = "auto"
    max_prompt_length: int = 4096  # longer prompts are left-truncated
    oversample_prompts: int = (
        0  # generate for this many prompts, keep prompts_per_step after filtering (0: no oversampling)
    )
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
    # Held-out evaluation during the run (rl/rollout/validation.py, docs/gppo.md "Evaluation during
    # training"): sets as NAME=FILE[,FILE...] in the formats tools/eval.py reads, evaluated through
    # the run's own engine with that step's weights every eval_interval steps (and before the first
    # with eval_before_train), eval_k samples a prompt; metrics eval/NAME/avg@k, pass@k, ...
    eval: list = field(default_factory=list)
    eval_interval: int = 0  # RL steps between evaluations (0: none during the run)
    eval_before_train: bool = False
    eval_k: int = 4
    eval_temperature: float = 0.6  # the paper's evaluation sampling (tools/eval.py's defaults)
    eval_top_p: float = 0.95
    eval_top_k: int = 20  # -1: off
    eval_max_new_tokens: int = 0  # 0: rollout.max_new_tokens
    eval_seed: int = 0
    # The rollouts on disk (rl/rollout/records.py, tools/rollouts.py): every response of every
    # dump_rollouts-th step as <save_dir>/rollouts/step_N.jsonl.gz (0: none), the last
    # dump_rollouts_keep files kept (0: all)
    dump_rollouts: int = 0
    dump_rollouts_keep: int = 0

    def validate(self):
        if self.eval and not (self.eval_interval or self.eval_before_train):
            raise ConfigError(
                "rl.eval names held-out sets but neither rl.eval_interval (> 0) nor rl.eval_before_train is set: "
                "nothing would evaluate them"
            )
        from megatron_klear.evaluation import parse_named

        try:
            parse_named(self.eval, "rl.eval")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for key in ("eval_interval", "eval_max_new_tokens", "dump_rollouts", "dump_rollouts_keep"):
            if getattr(self, key) < 0:
                raise ConfigError(f"rl.{key} must be >= 0, got {getattr(self, key)}")
        if self.eval_k < 1:
            raise ConfigError(f"rl.eval_k must be >= 1, got {self.eval_k}")
        formats = ("auto", "project", "verl", "livecodebench", "math")
        if self.prompts_format not in formats:
            raise ConfigError(f"rl.prompts_format={self.prompts_format!r}: expected one of {', '.join(formats)}")
        if self.algo not in POLICY_LOSSES:
            raise ConfigError(f"rl.algo must be one of {loss_names()}, got {self.algo!r}")
        if self.agg not in AGGREGATIONS:
            raise ConfigError(f"rl.agg must be one of {AGGREGATIONS}, got {self.agg!r}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"rl.dual_clip must be > 1 (or null), got {self.dual_clip}")
        try:  # the loss's eps (its defaults, a symmetric clip) and betas, as the actor will read them
            self.loss_settings.resolved("rl.")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ConfigError(
                f"rl.prompts_per_step={self.prompts_per_step} must be a multiple of "
                f"rl.mini_batch_prompts={self.mini_batch_prompts}"
            )
        try:
            self.correction.validate("rl")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.tis_cap is not None and POLICY_LOSSES[self.algo].uses_rollout_logprobs:
            # dppo_*: the rule's own weight min(pi / mu, cap) is taken against the engine's log-probs
            raise ConfigError(
                f"rl.algo={self.algo} with rl.tis_cap={self.tis_cap}: {self.algo}'s ratio pi / mu is taken "
                "against the engine's log-probs (the rollout policy), so it already carries the engine/trainer "
                "correction, stale tokens of asynchronous or partial rollouts included; rl.tis_cap would "
                "weight every token twice. Unset rl.tis_cap (rl.is_reject and rl.mask_stale_tokens combine "
                f"with {self.algo})"
            )
        if self.oversample_prompts and self.oversample_prompts < self.prompts_per_step:
            raise ConfigError(
                f"rl.oversample_prompts={self.oversample_prompts} must be >= rl.prompts_per_step="
                f"{self.prompts_per_step} (or 0: no oversampling)"
            )
        if self.max_generation_batches < 1:
            raise ConfigError(f"rl.max_generation_batches must be >= 1, got {self.max_generation_batches}")
        if self.on_shortfall not in ("train", "fail"):
            raise ConfigError(f"rl.on_shortfall must be train or fail, got {self.on_shortfall!r}")
        if self.temperature <= 0:
            raise ConfigError("rl.temperature must be > 0")
        if self.async_steps not in (0, 1):
            raise ConfigError(
                f"rl.async_steps={self.async_steps}: 0 (synchronous) or 1 (the next batch generates "
                "while the actor trains) are supported"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"rl.max_staleness must be >= 0, got {self.max_staleness}")
        if self.async_steps > self.max_staleness:
            raise ConfigError(
                f"rl.async_steps={self.async_steps} is larger than rl.max_staleness={self.max_staleness}: "
                "every asynchronous batch would be regenerated; set rl.max_staleness >= "
                f"{self.async_steps} (or rl.async_steps=0)"
            )

    @property
    def loss_settings(self) -> LossSettings:
        """The settings of the policy loss (rl/losses.py)."""
        return LossSettings(
            algo=self.algo,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            dual_clip=self.dual_clip,
            beta1=self.beta1,
            beta2=self.beta2,
            agg=self.agg,
            norm_constant=self.norm_constant,
            nll_coef=self.nll_coef,
        )

    @property
    def correction(self) -> Correction:
        """The engine/trainer importance correction (rl/importance.py)."""
        return Correction(self.tis_cap, self.is_level, self.is_reject, self.is_reject_low, self.is_reject_high)
