"""The GPU-path checks on the CPU, with the device facts injected (megatron_klear/platform/device_facts.py):
which FP8 recipe each device can run, TE's fp32 packed-attention gap, the fused kernels and DDP
settings each machine gets, and the RNG tracker's states in a checkpoint."""

import pytest
import torch

from megatron_klear.models.arch import arch_from_dict
from megatron_klear.models.builder import (
    ModelOptions,
    check_fp8,
    check_training_dtype,
    fp8_supported,
    resolve_backend,
    training_fusions,
)
from megatron_klear.platform.device_facts import DeviceFacts, device_facts, parse_version
from megatron_klear.training.setup import ddp_settings

CPU = DeviceFacts(mcore_version="0.16.1")
H100 = DeviceFacts(cuda=True, device_name="H100", capability=(9, 0), cuda_version="12.8", te_version="2.10.0")
H100_CU129 = DeviceFacts(cuda=True, capability=(9, 0), cuda_version="12.9", te_version="2.10.0")
L40S = DeviceFacts(cuda=True, capability=(8, 9), cuda_version="12.4", te_version="2.10.0")
A100 = DeviceFacts(cuda=True, capability=(8, 0), cuda_version="12.8", te_version="2.10.0")
B200 = DeviceFacts(cuda=True, capability=(10, 0), cuda_version="13.0", te_version="2.11.0")
H100_NO_TE = DeviceFacts(cuda=True, capability=(9, 0), cuda_version="12.8")


def _arch(**extra):
    cfg = dict(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    cfg.update(extra)
    return arch_from_dict(cfg)


def test_this_machine_s_facts_are_read_once():
    facts = device_facts()
    assert facts is device_facts()
    assert facts.cuda == torch.cuda.is_available() and facts.mcore_version.startswith("0.16")
    assert parse_version("2.10.0.dev0+abc123") == (2, 10, 0) and parse_version(None) == ()


@pytest.mark.parametrize(
    "facts,runs",
    [
        (H100, {"delayed", "tensorwise"}),  # blockwise needs CUDA 12.9, mxfp8 Blackwell
        (H100_CU129, {"delayed", "tensorwise", "blockwise"}),
        (L40S, {"delayed", "tensorwise"}),  # sm89 with CUDA >= 12.1
        (A100, set()),
        (B200, {"delayed", "tensorwise", "blockwise", "mxfp8"}),
        (H100_NO_TE, set()),
        (CPU, set()),
    ],
    ids=["h100", "h100-cuda12.9", "l40s", "a100", "b200", "no-te", "cpu"],
)
def test_fp8_recipes_by_device(facts, runs):
    assert {r for r in ("delayed", "tensorwise", "blockwise", "mxfp8") if fp8_supported(r, facts)} == runs


def test_an_fp8_recipe_the_device_cannot_run_is_refused_before_the_model_is_built():
    with pytest.raises(
        ValueError, match=r"fp8_recipe=mxfp8 needs compute capability 10.x.*H100 \(compute capability 9.0\)"
    ):
        check_fp8(ModelOptions(fp8="hybrid", fp8_recipe="mxfp8"), H100)
    with pytest.raises(ValueError, match=r"blockwise needs .*CUDA >= 12.9.*CUDA 12.8.*can run: delayed, tensorwise"):
        check_fp8(ModelOptions(fp8="hybrid", fp8_recipe="blockwise"), H100)
    check_fp8(ModelOptions(fp8="hybrid", fp8_recipe="blockwise"), H100_CU129)
    check_fp8(ModelOptions(fp8="e4m3", fp8_recipe="mxfp8"), B200)


def test_fp8_with_the_local_layers_or_without_te_is_refused():
    with pytest.raises(ValueError, match="model.fp8=hybrid needs model.backend=te"):
        resolve_backend(ModelOptions(fp8="hybrid", backend="local"), H100)
    with pytest.raises(ImportError, match="Transformer Engine is required"):
        check_fp8(ModelOptions(fp8="hybrid"), H100_NO_TE)
    assert resolve_backend(ModelOptions(), H100) == "te" and resolve_backend(ModelOptions(), H100_NO_TE) == "local"
    assert resolve_backend(ModelOptions(), CPU) == "local"


def test_fp32_training_with_te_before_2_11_is_refused():
    with pytest.raises(ValueError, match=r"model.dtype=fp32 with the Transformer Engine backend.*TE 2.10.0"):
        check_training_dtype(ModelOptions(dtype="fp32"), H100)
    check_training_dtype(ModelOptions(dtype="fp32"), B200)  # TE 2.11: its unfused attention takes THD
    check_training_dtype(ModelOptions(dtype="bf16"), H100)
    check_training_dtype(ModelOptions(dtype="fp32", backend="local"), H100)  # our own core attention
    check_training_dtype(ModelOptions(), H100)  # auto: bf16 on a GPU
    check_training_dtype(ModelOptions(), CPU)  # auto: fp32, local layers


def test_fp32_training_with_te_and_context_parallelism_is_refused_on_every_te_version():
    with pytest.raises(ValueError, match=r"parallel.cp=2.*TE 2.11.0 has no fp32 attention under context parallelism"):
        check_training_dtype(ModelOptions(dtype="fp32"), B200, cp=2)
    check_training_dtype(ModelOptions(dtype="bf16"), B200, cp=2)
    check_training_dtype(ModelOptions(dtype="fp32", backend="local"), B200, cp=2)  # our own core attention
    with pytest.raises(ValueError, match="model.fusions must be auto or off"):
        ModelOptions(fusions="fast").validate()


def test_model_fusions_off_reads_from_the_command_line_and_yaml(tmp_path):
    """YAML reads a bare ``off`` as false (the config's loader is yaml.safe_load): it means off."""
    from megatron_klear.config import load_config

    assert load_config(None, ["model.fusions=off"]).model.fusions == "off"
    assert load_config(None, []).model.fusions == "auto"
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  fusions: off\n")
    assert load_config(str(path), []).model.fusions == "off"


def test_the_fused_kernels_each_machine_gets():
    cpu = training_fusions(_arch(), CPU)
    assert not any(cpu.values())  # none of them runs without CUDA
    gpu = training_fusions(_arch(), H100)
    assert gpu["apply_rope_fusion"] and gpu["deallocate_pipeline_outputs"] and gpu["bias_activation_fusion"]
    # the output layer is Megatron's own linear: gradient-accumulation fusion needs apex's kernel
    assert not gpu["gradient_accumulation_fusion"]
    apex = DeviceFacts(cuda=True, capability=(9, 0), te_version="2.10.0", apex_fused_wgrad=True)
    assert training_fusions(_arch(), apex)["gradient_accumulation_fusion"]
    assert not training_fusions(_arch(), H100_NO_TE)["apply_rope_fusion"]  # TE's kernel
    yarn = _arch(rope_scaling={"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 128})
    assert not training_fusions(yarn, H100)["apply_rope_fusion"]  # TE's THD kernel would drop YaRN's mscale
    assert set(cpu) == set(gpu)
    assert not any(training_fusions(_arch(), H100, "off").values())  # model.fusions=off


@pytest.fixture
def rope_kernel_present(monkeypatch):
    """TE's fused RoPE as Megatron-Core's config check looks for it (``transformer_config.py``
    ``__post_init__``: apply_rope_fusion needs ``fused_apply_rotary_pos_emb_thd`` from TE)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_klear.platform import deferred_compile

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)
    before = deferred_compile.fusions()
    yield
    deferred_compile.set_fusions(before)


@pytest.mark.parametrize("fusions", ["auto", "off"])
def test_the_transformer_config_a_gpu_job_hands_megatron(rope_kernel_present, fusions):
    """The GPU ``TransformerConfig`` built here with an H100's facts (TE 2.10, no apex): what
    Megatron-Core is given, and the switch of the ``jit_fuser`` functions the flags do not reach."""
    from megatron_klear.models.builder import transformer_config
    from megatron_klear.platform import ParallelConfig, deferred_compile

    config = transformer_config(_arch(), ModelOptions(fusions=fusions), ParallelConfig(), facts=H100, cpu_init=True)
    on = fusions == "auto"
    assert config.params_dtype == torch.bfloat16 and config.bf16  # auto: bf16 on a GPU
    for name in ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion"):
        assert getattr(config, name) is on, name
    assert config.deallocate_pipeline_outputs is on and not config.gradient_accumulation_fusion  # no apex
    assert deferred_compile.fusions() is on


def test_a_cpu_transformer_config_gets_the_cpu_settings():
    from megatron_klear.models.builder import transformer_config
    from megatron_klear.platform import ParallelConfig

    config = transformer_config(_arch(), ModelOptions(), ParallelConfig(), facts=CPU)
    assert not config.apply_rope_fusion and not config.gradient_accumulation_fusion
    assert config.params_dtype == torch.float32


def test_fp8_settings_by_recipe():
    from megatron_klear.models.builder import fp8_settings

    assert fp8_settings(ModelOptions()) == {}
    delayed = fp8_settings(ModelOptions(fp8="hybrid"))
    assert delayed == dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    assert fp8_settings(ModelOptions(fp8="e4m3", fp8_recipe="blockwise")) == dict(fp8="e4m3", fp8_recipe="blockwise")


def test_ddp_settings():
    fp16 = ddp_settings(torch.float16, True, H100)
    assert fp16["check_for_nan_in_grad"] is False  # an overflow is the optimizer's to skip
    assert ddp_settings(torch.bfloat16, True, H100)["check_for_nan_in_grad"] is True
    assert fp16["overlap_grad_reduce"] and not ddp_settings(torch.float32, False, CPU)["overlap_grad_reduce"]
    # the push reads the parameters right after the step: their gather must not be deferred
    assert not fp16["overlap_param_gather"]


def test_checkpoints_keep_the_model_parallel_rng_tracker(monkeypatch):
    """The tracker's states (dropout and init forks per TP/EP rank) go into the checkpoint and come
    back; on the CPU Megatron's tracker is the stateless inference one, so a real tracker with CPU
    generator states stands in for the GPU's."""
    import megatron.core.tensor_parallel as tp
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from megatron_klear.training.checkpointing import rng_state, set_rng_state

    tracker = CudaRNGStatesTracker()
    g = torch.Generator().manual_seed(3)
    tracker.set_states({"model-parallel-rng": g.get_state(), "expert-parallel-rng": g.manual_seed(4).get_state()})
    monkeypatch.setattr(tp, "get_cuda_rng_tracker", lambda: tracker)
    saved = rng_state()
    want = {k: v.clone() for k, v in tracker.get_states().items()}
    tracker.set_states({k: torch.Generator().manual_seed(99).get_state() for k in want})
    set_rng_state(saved)
    got = tracker.get_states()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    set_rng_state({k: v for k, v in saved.items() if k != "tracker"})  # an older checkpoint: the rest restored


def test_random_states_are_restored_only_onto_the_world_and_layout_that_saved_them():
    """Rank r's tracker states are its TP and EP ranks' streams: on the same world size with another
    TP/PP/CP/EP split, rank r would take another rank's (TP ranks with one dropout mask)."""
    from megatron_klear.platform import ParallelConfig
    from megatron_klear.training.checkpointing import parallel_layout, rng_restore_refusal

    tp2 = parallel_layout(ParallelConfig(tp=2))
    assert tp2 == {"tp": 2, "pp": 1, "vpp": None, "cp": 1, "ep": 1, "etp": 1}
    saved = {"world_size": 4, "layout": tp2}
    assert rng_restore_refusal(saved, 4, tp2) is None
    assert rng_restore_refusal(saved, 4, parallel_layout(ParallelConfig())) == "world size 4->4, tp=2->1"
    assert rng_restore_refusal(saved, 2, tp2) == "world size 4->2"
    assert rng_restore_refusal(saved, 4, parallel_layout(ParallelConfig(tp=2, ep=2))) == "world size 4->4, ep=1->2"
    assert rng_restore_refusal({"world_size": 4}, 4, tp2) is None  # an older manifest: its world size alone


def test_a_gpu_tensor_goes_to_a_cpu_update_group_by_a_blocking_copy():
    """A CUDA tensor copied to the CPU with ``non_blocking`` may be broadcast over gloo before the
    copy has finished; toward CUDA (NCCL groups) the copy stays asynchronous."""
    from megatron_klear.rollout.weight_sync.distributed_buckets import on_wire_device

    class Recorder:
        def to(self, dev, non_blocking=False):
            return (str(dev), non_blocking)

    assert on_wire_device(Recorder(), torch.device("cpu")) == ("cpu", False)
    assert on_wire_device(Recorder(), torch.device("cuda", 0)) == ("cuda:0", True)


def test_a_trainer_whose_nccl_settings_differ_from_its_servers_is_named():
    """The servers' values by SGLang 0.5.23's rule (engine.py ``_set_envs_and_config``): kept when
    their environment sets them (the launchers give every step the job's), else 0; 1 with the
    symmetric-memory or NVLS flags of /server_info's server arguments."""
    from megatron_klear.platform.device_facts import nccl_update_group_gaps, sglang_nccl_env

    assert sglang_nccl_env({}) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    assert sglang_nccl_env({"NCCL_CUMEM_ENABLE": "1"}) == {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    assert sglang_nccl_env({}, {"enable_nccl_nvls": True}) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "1"}
    assert sglang_nccl_env({"NCCL_CUMEM_ENABLE": "0"}, {"enable_symm_mem": True})["NCCL_CUMEM_ENABLE"] == "1"
    bare = DeviceFacts(cuda=True, capability=(9, 0))  # torchrun without the launchers' exports
    assert nccl_update_group_gaps(bare) == [
        "NCCL_CUMEM_ENABLE=<unset> (servers: 0)",
        "NCCL_NVLS_ENABLE=<unset> (servers: 0)",
    ]
    launched = DeviceFacts(cuda=True, nccl_env={"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"})
    assert nccl_update_group_gaps(launched) == []
    assert nccl_update_group_gaps(launched, {"enable_nccl_nvls": True}) == ["NCCL_NVLS_ENABLE=0 (servers: 1)"]
    # a job that exports 1 to every step: SGLang keeps it, the two ends agree (the old rule warned)
    both_on = DeviceFacts(cuda=True, nccl_env={"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"})
    assert nccl_update_group_gaps(both_on) == []
    assert nccl_update_group_gaps(both_on, server_env={}) == [
        "NCCL_CUMEM_ENABLE=1 (servers: 0)",
        "NCCL_NVLS_ENABLE=1 (servers: 0)",
    ]
