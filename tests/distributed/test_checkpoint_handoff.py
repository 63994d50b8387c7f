"""model.path accepts any checkpoint: a training checkpoint (model + optimizer + RNG + common
state) starts a new job at another TP/PP with its weights and a fresh optimizer; ``_extra_state``
differences (Transformer Engine vs local layers) are ignored both ways; a missing or unexpected
real weight is an error naming the key and the directory; Megatron -> HF export reads such
checkpoints too.

Three spawns: write the checkpoints at TP=2, load them at PP=2, load at TP=1 and export.
"""

import os
import shutil

import pytest
import torch

from tests.distributed.helper import run_distributed

EXTRA_STATE_KEYS = [  # what a Transformer Engine model has and a local-spec one does not
    "decoder.layers.self_attention.q_layernorm._extra_state",
    "decoder.layers.self_attention.k_layernorm._extra_state",
    "decoder.final_layernorm._extra_state",
]
DROPPED = "decoder.final_layernorm.weight"
BOGUS = "decoder.layers.self_attention.bogus_proj.weight"


# ---- helpers run inside the spawned ranks ----------------------------------------------------------
def _config(model_path, root, **parallel):
    from megatron_klear.config import load_config

    return load_config(
        None,
        [
            f"model.path={model_path}",
            f"train.save_dir={root}/run",
            "train.steps=1",
            "optim.lr=1e-2",
            "optim.min_lr=1e-2",
            "optim.warmup_steps=0",
            "optim.weight_decay=0.0",
            "optim.decay_style=constant",
            *[f"parallel.{k}={v}" for k, v in parallel.items()],
        ],
    )


def _hf_tensors(chunks):
    from megatron.core import parallel_state

    from megatron_klear.checkpoint.model_weights import iter_hf_tensors

    group = parallel_state.get_tensor_model_parallel_group()
    return {name: t.detach().clone() for name, t in iter_hf_tensors(chunks, tp_group=group)}


def _optimizer_is_fresh(optimizer) -> bool:
    return all(len(o.optimizer.state) == 0 for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _raw(chunks):
    from megatron_klear.checkpoint.model_weights import unwrap

    return [unwrap(c) for c in chunks]


@torch.no_grad()
def _zero(chunks):
    for chunk in chunks:
        for p in chunk.parameters():
            p.zero_()


def _save_model_only(chunks, out, hf_dir, edit):
    """A model-only torch_dist checkpoint of ``chunks`` with its sharded state dict edited."""
    from megatron.core import dist_checkpointing

    from megatron_klear.checkpoint import dist_ckpt

    sharded = dist_ckpt.model_sharded_state_dict(chunks)
    edit(sharded["model"])
    if torch.distributed.get_rank() == 0:
        os.makedirs(out)
        shutil.copy(os.path.join(hf_dir, "config.json"), os.path.join(out, dist_ckpt.HF_CONFIG))
    torch.distributed.barrier()
    dist_checkpointing.save(sharded, out, sharded_strategy=dist_ckpt.save_strategy())
    torch.distributed.barrier()
    return out


def _add_extra_state(model_sd):
    """What Transformer Engine adds: ``_extra_state`` objects next to the real weights."""
    from megatron.core.dist_checkpointing import ShardedObject

    rank = torch.distributed.get_rank()
    for key in EXTRA_STATE_KEYS:
        model_sd[key] = ShardedObject(key, torch.arange(4, dtype=torch.uint8), (1,), (0,), replica_id=rank)


def _write(rank, world, hf_dir, root):
    """TP=2: one optimizer step, a training checkpoint, and three model-only variants."""
    import zlib

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_klear.platform import init_parallel
    from megatron_klear.training.checkpointing import CheckpointManager
    from megatron_klear.training.setup import build_training_state

    cfg = _config(hf_dir, root, tp=2)
    init_parallel(cfg.parallel, seed=0)
    state = build_training_state(cfg, total_steps=1)
    initial = _hf_tensors(state.model)
    fresh_before = _optimizer_is_fresh(state.optimizer)
    for chunk in state.model:
        for name, p in chunk.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    ok, _, _ = state.optimizer.step()
    assert ok
    saved = _hf_tensors(state.model)
    iter_dir = CheckpointManager(cfg.train.save_dir, keep_last=1, model_source=hf_dir).save(state, 1, {"note": "sft"})
    keys = sorted(v.key for v in dist_checkpointing.serialization.load_sharded_metadata(iter_dir).values())

    raw = _raw(state.model)

    def drop(sd):
        [name] = [k for k, v in sd.items() if getattr(v, "key", None) == DROPPED]
        del sd[name]

    def bogus(sd):
        sd["bogus"] = ShardedTensor.from_rank_offsets(BOGUS, torch.ones(3, 4), replica_id=rank)

    variants = {
        "te_like": _save_model_only(raw, f"{root}/te_like", hf_dir, _add_extra_state),
        "missing": _save_model_only(raw, f"{root}/missing", hf_dir, drop),
        "unexpected": _save_model_only(raw, f"{root}/unexpected", hf_dir, bogus),
    }
    te_keys = sorted(
        v.key for v in dist_checkpointing.serialization.load_sharded_metadata(variants["te_like"]).values()
    )
    return {
        "initial": initial,
        "saved": saved,
        "iter_dir": iter_dir,
        "keys": keys,
        "te_keys": te_keys,
        "variants": variants,
        "fresh_before": fresh_before,
        "fresh_after": _optimizer_is_fresh(state.optimizer),
    }


def _attempt(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def _load_pp2(rank, world, iter_dir, variants, root):
    """PP=2: a new job from the training checkpoint, then the variants into its model."""
    from megatron.core.dist_checkpointing import ShardedObject

    from megatron_klear.checkpoint import dist_ckpt
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.setup import build_training_state

    cfg = _config(iter_dir, root, pp=2)
    init_parallel(cfg.parallel, seed=0)
    state = build_training_state(cfg, total_steps=1)
    out = {"job": _hf_tensors(state.model), "fresh": _optimizer_is_fresh(state.optimizer), "step": state.step}
    raw = _raw(state.model)

    # TE-written checkpoint (extra _extra_state objects) into local-spec layers
    _zero(raw)
    dist_ckpt.load_model(raw, variants["te_like"])
    out["from_te_like"] = _hf_tensors(state.model)

    # a local checkpoint into a model that asks for _extra_state the checkpoint lacks (as TE does)
    for m in raw:
        plain = m.sharded_state_dict

        def asking_for_extra_state(*a, _plain=plain, **kw):
            sd = _plain(*a, **kw)
            for key in EXTRA_STATE_KEYS:
                sd[key] = ShardedObject(key, torch.zeros(4, dtype=torch.uint8), (1,), (0,), replica_id=rank)
            return sd

        m.sharded_state_dict = asking_for_extra_state
    _zero(raw)
    dist_ckpt.load_model(raw, iter_dir)
    out["asking_extra_state"] = _hf_tensors(state.model)
    for m in raw:
        del m.sharded_state_dict

    out["missing_error"] = _attempt(dist_ckpt.load_model, raw, variants["missing"])
    out["unexpected_error"] = _attempt(dist_ckpt.load_model, raw, variants["unexpected"])
    return out


def _load_tp1_and_export(rank, world, iter_dir, variants, root):
    from safetensors.torch import load_file

    from megatron_klear.checkpoint.convert import megatron_to_hf
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.setup import build_training_state
    from tools.convert_megatron_to_hf import main as export_cli

    cfg = _config(iter_dir, root, tp=1)
    init_parallel(cfg.parallel, seed=0)
    state = build_training_state(cfg, total_steps=1)
    out = {"job": _hf_tensors(state.model), "fresh": _optimizer_is_fresh(state.optimizer), "step": state.step}

    def read(d):
        tensors = {}
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(d, name)))
        return tensors

    assert export_cli(["--ckpt", iter_dir, "--out", f"{root}/hf-iter"]) == 0
    out["export_iter"] = read(f"{root}/hf-iter")
    out["export_te_like"] = read(megatron_to_hf(variants["te_like"], f"{root}/hf-te", progress=False))
    out["export_unexpected"] = _attempt(megatron_to_hf, variants["unexpected"], f"{root}/hf-bad", progress=False)
    return out


# ---- tests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("handoff")
    hf = make_tiny_qwen3(str(root / "hf"), num_layers=2, num_heads=4, num_kv_heads=2, seed=5)
    result = run_distributed(_write, 2, hf, str(root))[0]
    return {**result, "root": str(root)}


@pytest.fixture(scope="module")
def pp2(written):
    return run_distributed(_load_pp2, 2, written["iter_dir"], written["variants"], written["root"] + "/pp2")


@pytest.fixture(scope="module")
def tp1(written):
    return run_distributed(_load_tp1_and_export, 1, written["iter_dir"], written["variants"], written["root"] + "/tp1")[
        0
    ]


def _assert_equal(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


def _merge(per_rank, key):
    merged = {}
    for r in per_rank:
        for name, t in r[key].items():
            assert name not in merged or torch.equal(merged[name], t)
            merged[name] = t
    return merged


def test_training_checkpoint_holds_job_state_and_new_weights(written):
    keys = written["keys"]
    assert any(k.startswith("optimizer.") for k in keys), keys  # what made RAISE_ALL fail
    assert "rng_state" in keys
    assert written["fresh_before"] and not written["fresh_after"]
    changed = [k for k in written["saved"] if not torch.equal(written["saved"][k], written["initial"][k])]
    assert len(changed) == len(written["saved"])  # the step moved every weight
    assert set(EXTRA_STATE_KEYS) <= set(written["te_keys"])


def test_training_checkpoint_starts_a_new_job_at_tp1(written, tp1):
    _assert_equal(tp1["job"], written["saved"], "TP=2 checkpoint -> TP=1 job")
    assert tp1["fresh"] and tp1["step"] == 0


def test_training_checkpoint_starts_a_new_job_at_pp2(written, pp2):
    _assert_equal(_merge(pp2, "job"), written["saved"], "TP=2 checkpoint -> PP=2 job")
    assert all(r["fresh"] and r["step"] == 0 for r in pp2)


def test_extra_state_differences_are_ignored_both_ways(written, pp2):
    _assert_equal(_merge(pp2, "from_te_like"), written["saved"], "checkpoint with extra _extra_state")
    _assert_equal(_merge(pp2, "asking_extra_state"), written["saved"], "model asking for _extra_state")


def test_real_weight_mismatch_names_the_key_and_the_directory(written, pp2):
    for r in pp2:  # on every rank, though only the last stage asks for the final norm
        missing, unexpected = r["missing_error"], r["unexpected_error"]
        assert missing.startswith("CheckpointMismatchError"), missing
        assert DROPPED in missing and written["variants"]["missing"] in missing and "lacks" in missing
        assert unexpected.startswith("CheckpointMismatchError"), unexpected
        assert BOGUS in unexpected and written["variants"]["unexpected"] in unexpected
        assert "does not have" in unexpected
        assert "_extra_state" not in missing + unexpected and "optimizer" not in missing + unexpected


def test_export_of_training_and_te_checkpoints(written, tp1):
    _assert_equal(tp1["export_iter"], written["saved"], "export of a training checkpoint")
    _assert_equal(tp1["export_te_like"], written["saved"], "export of a checkpoint with _extra_state")
    assert "MappingError" in tp1["export_unexpected"] and BOGUS in tp1["export_unexpected"]
    assert written["variants"]["unexpected"] in tp1["export_unexpected"]
    assert not os.path.exists(os.path.join(written["root"], "tp1", "hf-bad"))
