"""Trainer -> engine weight sync through the mapping: at TP=2 and PP=2 (and TP=2 x PP=2) rank 0
receives every HF tensor exactly once, bit-identical to the checkpoint the trainer loaded."""

import pytest

from tests.distributed.helper import run_distributed


class RecordingEngine:
    def __init__(self):
        self.got = {}

    def update_weights(self, named_tensors, version=None):
        for name, t in named_tensors:
            assert name not in self.got, f"{name} sent twice"
            self.got[name] = t.clone()


def _sync(rank, world, model_dir, overrides, out_dir):
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rollout.weight_sync import export_hf_for_engine, sync_weights
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(None, [f"model.path={model_dir}", *overrides])
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    engine = RecordingEngine()
    sync_weights(state.model, engine)
    export_hf_for_engine(state.model, state.arch, out_dir, tokenizer_dir=model_dir)
    return engine.got if rank == 0 else None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(str(tmp_path_factory.mktemp("sync") / "m"), num_layers=4, tied=True, seed=9)


@pytest.mark.parametrize(
    "world,extra",
    [(2, ["parallel.tp=2"]), (2, ["parallel.pp=2"]), (4, ["parallel.tp=2", "parallel.pp=2"])],
    ids=["tp2", "pp2", "tp2pp2"],
)
def test_sync_delivers_the_checkpoint(model_dir, tmp_path, world, extra):
    import torch

    from megatron_klear.checkpoint.hf_io import HFReader

    got = run_distributed(_sync, world, model_dir, extra, str(tmp_path / "exported"))[0]
    ref = HFReader(model_dir)
    assert set(got) == ref.keys()
    for k in ref.keys():
        assert torch.equal(got[k], ref.get(k)), k
    exported = HFReader(str(tmp_path / "exported"))
    assert exported.keys() == ref.keys()
    assert all(torch.equal(exported.get(k), ref.get(k)) for k in ref.keys())
