"""Qwen3-MoE weight sync at EP=2 (issue 12): Megatron lays an EP group over data-parallel ranks, so
the stage leader (dp=0) holds half of the experts and its EP peer (dp=1) the other half. Every path
from the trainer to a rollout engine -- the in-process stream (``sync_weights``), the HF checkpoint
written for ``rollout.weight_sync=disk`` and SGLang's distributed update into an embedded server --
must deliver every expert, bit-identical to the checkpoint the trainer loaded (the one-process
model's tensors); the server then holds what transformers' own loader makes of that checkpoint. At
PP=2 x EP=2 (4 processes, slow) the second stage's leader sends to rank 0 while its EP peer helps."""

import pytest

from tests.distributed.helper import run_distributed
from tests.distributed.test_weight_sync import RecordingEngine

LAYERS, EXPERTS = 4, 8  # layer 1 dense (mlp_only_layers)


def _sync_at_ep2(rank, world, model_dir, overrides, out_dir, url):
    from megatron.core import parallel_state as ps

    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.weight_sync import DistributedWeightSync, export_hf_for_engine, sync_weights
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(None, [f"model.path={model_dir}", *overrides])
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    layout = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank())
    engine = RecordingEngine()
    sync_weights(state.model, engine)
    written = export_hf_for_engine(state.model, state.arch, out_dir, tokenizer_dir=model_dir)
    sync = DistributedWeightSync(
        state.model,
        SGLangEngine.at([url], control_timeout_s=10) if rank == 0 else None,
        bucket_mb=0.05,
        group_timeout=60,
        bucket_timeout=60,
    )
    try:
        stats = sync.sync(version=7)
    finally:
        sync.close()
    return {"layout": layout, "got": engine.got if rank == 0 else None, "written": written, "stats": stats}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("moe_sync")
    kw = dict(num_layers=LAYERS, num_experts=EXPERTS, mlp_only_layers=(1,))
    return {
        "a": make_tiny_qwen3_moe(str(root / "a"), seed=31, **kw),  # what the server starts with
        "b": make_tiny_qwen3_moe(str(root / "b"), seed=32, **kw),
    }  # the trainer's weights


@pytest.mark.parametrize(
    "world,overrides",
    [(2, ["parallel.ep=2"]), pytest.param(4, ["parallel.pp=2", "parallel.ep=2"], marks=pytest.mark.slow)],
    ids=["ep2", "pp2xep2"],
)
def test_every_expert_reaches_the_engines_at_ep2(models, tmp_path, world, overrides):
    import httpx
    import torch

    from megatron_klear.checkpoint.hf_io import HFReader
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    server = EmbeddedHTTPEngine.launch(models["a"], weight_sync_timeout=30, startup_timeout=120)
    try:

        def checksums():
            return httpx.get(server.url + "/weights_checker", timeout=60).json()["ranks"][0]["checksums"]

        want = EmbeddedEngine.from_pretrained(models["b"]).weights.checksums()  # transformers' loader, one process
        assert checksums() != want
        exported = str(tmp_path / "exported")
        out = run_distributed(_sync_at_ep2, world, models["b"], overrides, exported, server.url, timeout=300)
        # the layout under test: in each stage, the two EP ranks are the two data-parallel replicas
        for stage in range(world // 2):
            assert sorted(r["layout"][1:] for r in out if r["layout"][0] == stage) == [(0, 0), (1, 1)]
        ref = HFReader(models["b"])
        experts = {k for k in ref.keys() if ".mlp.experts." in k}
        assert len(experts) == (LAYERS - 1) * EXPERTS * 3  # the reference itself has every expert
        # in-process stream to rank 0's engine
        got = out[0]["got"]
        assert set(got) == ref.keys(), sorted(ref.keys() ^ set(got))[:5]
        for k in ref.keys():
            assert torch.equal(got[k], ref.get(k)), k
        # rollout.weight_sync=disk: the checkpoint written, and what a server loads from it
        assert out[0]["written"] == exported and all(r["written"] is None for r in out[1:])
        disk = HFReader(exported)
        assert disk.keys() == ref.keys(), sorted(disk.keys() ^ ref.keys())[:5]
        for k in ref.keys():
            assert torch.equal(disk.get(k), ref.get(k)), k
        # rollout.weight_sync=distributed (ran last): the server holds the trainer's weights, version 7
        total = sum(ref.get(k).numel() * ref.get(k).element_size() for k in ref.keys())
        assert out[0]["stats"]["bytes"] == total, out[0]["stats"]
        assert checksums() == want
        assert httpx.get(server.url + "/model_info", timeout=10).json()["weight_version"] == "7"
        SGLangEngine.at([server.url]).load_from_disk(models["a"], version="a")
        assert checksums() != want
        SGLangEngine.at([server.url]).load_from_disk(exported, version="disk")
        assert checksums() == want
    finally:
        server.close()
