"""The job config: defaults, YAML with file:line errors, CLI overrides, validation."""

import pytest

from megatron_klear.config import ConfigError, dump_config, load_config


def test_defaults_are_the_papers():
    cfg = load_config()
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.decay_style, cfg.train.epochs) == (8e-5, 4e-5, "cosine", 4)
    assert (cfg.rl.algo, cfg.rl.dual_clip, cfg.rl.nll_coef, cfg.rl.agg) == ("gppo", 10.0, 0.1, "token_mean")
    assert (cfg.rl.prompts_per_step, cfg.rl.responses_per_prompt, cfg.rl.mini_batch_prompts) == (128, 8, 16)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: /m\nparallel:\n  tp: 2\noptim:\n  lr: 1e-4\n")
    cfg = load_config(str(path), ["parallel.tp=4", "optim.warmup_steps=10", "rl.eps_high=0.3"])
    assert (cfg.model.path, cfg.parallel.tp, cfg.optim.lr, cfg.optim.warmup_steps, cfg.rl.eps_high) == (
        "/m",
        4,
        1e-4,
        10,
        0.3,
    )
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(str(again)) == cfg  # a dumped config loads back to the same thing


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        (
            "optim:\n  lr: 1e-4\n  warmpu_steps: 3\n",
            r"c.yaml:3: unknown key 'optim.warmpu_steps' \(did you mean 'optim.warmup_steps'\?\)",
        ),
        ("parallel:\n  tp: two\n", r"c.yaml:2: key 'parallel.tp' expects int, got 'two'"),
        ("bogus:\n  x: 1\n", r"c.yaml:2: unknown key 'bogus.x'"),
        ("optim: [1, 2\n", r"c.yaml:\d+: invalid YAML"),
        ("rl:\n  dual_clip: 1.0\n", r"rl.dual_clip must be > 1"),
        ("rl:\n  algo: grpo\n", r"rl.algo must be one of"),
        ("optim:\n  lr: 1e-5\n  min_lr: 1e-4\n", r"min_lr <= lr"),
    ],
)
def test_bad_yaml(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


def test_bad_overrides():
    with pytest.raises(ConfigError, match=r"command line: unknown key 'train.stpes' \(did you mean 'train.steps'\?\)"):
        load_config(None, ["train.stpes=3"])
    with pytest.raises(ConfigError, match="not of the form key.sub=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent.yaml")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.cp=2", "rl.agg=seq_mean_token_mean"], "seq_mean_token_mean is not supported with parallel.cp > 1"),
        (["parallel.pp=2", "parallel.vpp=2", "data.micro_batches_per_step=3"], "must be a multiple of parallel.pp=2"),
        (["rl.prompts=[p.jsonl]", "rl.max_tokens_per_micro_batch=32768"], "cannot hold the longest sample"),
        # the proximal policy must be a function of the weights; FP8 against bf16 rollouts needs a correction
        (["rl.prompts=[p.jsonl]", "model.attention_dropout=0.1"], "model.attention_dropout=0.1 in an RL job"),
        (["rl.prompts=[p.jsonl]", "model.fp8=hybrid"], "model.fp8=hybrid in an RL job without an importance"),
        (
            ["rl.prompts=[p.jsonl]", "parallel.pp=2", "parallel.vpp=2", "data.micro_batches_per_step=2"],
            "does not run under the interleaved pipeline schedule",
        ),
        (["rollout.engine=sglang"], "needs rollout.urls"),
        # asynchronous and partial rollouts: servers that abort and continue, on their own GPUs
        (["rl.async_steps=1"], r"rl.async_steps need rollout servers .* set rollout.engine=sglang"),
        (["rollout.partial=true"], r"rollout.partial need rollout servers"),
        (
            ["rl.async_steps=1", "rollout.engine=sglang", "rollout.urls=[http://h:1]", "rollout.colocate=true"],
            r"rl.async_steps with rollout.colocate: .*rollout.colocate=false\) or set rl.async_steps=0",
        ),
        (["rl.async_steps=1", "rl.max_staleness=0"], r"larger than rl.max_staleness=0: .* set rl.max_staleness >= 1"),
        (["rl.async_steps=2", "rl.max_staleness=2"], r"rl.async_steps=2: 0 \(synchronous\) or 1"),
    ],
)
def test_checks_across_sections(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_router_replay_takes_every_layout():
    assert load_config(None, ["rollout.router_replay=true"]).rollout.router_replay is True
    assert (
        load_config(
            None,
            [
                "rollout.router_replay=true",
                "parallel.tp=2",  # SP: each rank replays its slice
                "parallel.sequence_parallel=true",
            ],
        ).parallel.sequence_parallel
        is True
    )
    assert load_config(None, ["rollout.router_replay=true", "parallel.cp=2"]).parallel.cp == 2  # CP: its chunks


def test_fp8_in_rl_is_accepted_with_a_correction_and_dropout_in_sft():
    from megatron_klear.config import load_config

    rl = ["rl.prompts=[p.jsonl]", "rl.max_tokens_per_micro_batch=40000"]
    assert load_config(None, [*rl, "model.fp8=hybrid", "rl.tis_cap=2.0"]).model.fp8 == "hybrid"
    assert load_config(None, ["model.hidden_dropout=0.1"]).model.hidden_dropout == 0.1  # SFT: no proximal policy
