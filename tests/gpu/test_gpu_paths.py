"""GPU-only paths: Transformer Engine layer specs, FP8, NCCL. Skipped on machines without CUDA
(marked ``gpu``); run them on a GPU machine with ``pytest -m gpu tests/gpu``."""

import math

import pytest

from tests.distributed.helper import run_distributed
from tests.distributed.test_moe_actor import moe_noaux_dir  # noqa: F401 -- the fixture, shared

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    # TE's fused attention wants head_dim % 8 == 0 and FP8 wants dims % 16 == 0
    return make_tiny_qwen3(
        str(tmp_path_factory.mktemp("gpu") / "m"),
        num_layers=2,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        seed=7,
    )


def _parity(rank, world, model_dir, backend):
    from megatron_klear.checkpoint.parity import check_parity

    return check_parity(model_dir, backend=backend, seq_len=64)


def test_local_spec_on_the_gpu_matches_hf(model_dir):
    """No Transformer Engine needed: our attention/norm specs, models and batches on CUDA, NCCL."""
    diff = run_distributed(_parity, 1, model_dir, "local", backend="nccl")[0]
    assert diff < 2e-3, diff


def test_te_spec_logits_match_hf(model_dir):
    pytest.importorskip("transformer_engine")
    diff = run_distributed(_parity, 1, model_dir, "te", backend="nccl")[0]
    assert diff < 2e-3, diff  # TE kernels (TF32 / fused attention) vs transformers in fp32


def _fp8_forward(rank, world, model_dir):
    import torch

    from megatron_klear.checkpoint.hf_io import HFReader
    from megatron_klear.checkpoint.model_weights import load_hf_weights
    from megatron_klear.models.arch import load_arch
    from megatron_klear.models.builder import ModelOptions, build_model
    from megatron_klear.platform import ParallelConfig, init_parallel

    init_parallel()
    arch = load_arch(model_dir)
    out = {}
    for name, opts in (
        ("bf16", ModelOptions(dtype="bf16", backend="te")),
        ("fp8", ModelOptions(dtype="bf16", backend="te", fp8="hybrid", fp8_recipe="delayed")),
    ):
        model = build_model(arch, opts, ParallelConfig()).eval()
        load_hf_weights([model], HFReader(model_dir))
        tokens = torch.randint(0, arch.vocab_size, (2, 64), device="cuda")
        with torch.no_grad():
            if opts.fp8:
                from megatron.core.fp8_utils import get_fp8_context

                with get_fp8_context(model.config):
                    logits = model(tokens, None, None)
            else:
                logits = model(tokens, None, None)
        out[name] = logits.float().cpu()
    return out


def test_fp8_forward_runs_and_stays_close_to_bf16(model_dir):
    pytest.importorskip("transformer_engine")
    out = run_distributed(_fp8_forward, 1, model_dir, backend="nccl")[0]
    assert all(math.isfinite(float(v.abs().max())) for v in out.values())
    rel = float((out["fp8"] - out["bf16"]).norm() / out["bf16"].norm())
    assert rel < 0.1, rel


def _sft_steps(rank, world, overrides):
    import json
    import os

    from megatron_klear.config import load_config
    from megatron_klear.sft.trainer import train

    cfg = load_config(None, overrides)
    train(cfg)
    return [json.loads(x)["loss"] for x in open(os.path.join(cfg.train.save_dir, "metrics.jsonl"))]


def test_sft_with_te_packed_attention_matches_local_spec(model_dir, tmp_path):
    import io

    pytest.importorskip("transformer_engine")
    from megatron_klear.data.preprocess import PreprocessConfig, preprocess
    from megatron_klear.data.synthetic import write_sft_jsonl

    jsonl = write_sft_jsonl(str(tmp_path / "t.jsonl"), 64)
    preprocess(
        PreprocessConfig(inputs=[jsonl], tokenizer=model_dir, output_prefix=str(tmp_path / "d"), max_length=128),
        stream=io.StringIO(),
    )
    losses = {}
    for backend in ("te", "local"):
        args = [
            f"model.path={model_dir}",
            f"data.prefix={tmp_path / 'd'}",
            "data.seq_length=256",
            # bf16: every training forward is packed (THD), and TE before 2.11 has no fp32 THD attention
            # (training/setup.py refuses it: tests/test_device_facts.py)
            "model.dtype=bf16",
            f"model.backend={backend}",
            "train.steps=3",
            "optim.lr=1e-3",
            "optim.min_lr=1e-3",
            f"train.save_dir={tmp_path / backend}",
        ]
        losses[backend] = run_distributed(_sft_steps, 1, args, backend="nccl")[0]
    assert len(losses["te"]) == len(losses["local"]) == 3
    for a, b in zip(losses["te"], losses["local"]):
        assert abs(a - b) < 2e-2 * abs(b), losses  # bf16: two attention kernels, two reduction orders


def test_sft_on_the_gpu_with_the_local_spec(model_dir, tmp_path):
    """Packed SFT steps on CUDA without Transformer Engine: finite, falling loss."""
    import io

    from megatron_klear.data.preprocess import PreprocessConfig, preprocess
    from megatron_klear.data.synthetic import write_sft_jsonl

    jsonl = write_sft_jsonl(str(tmp_path / "t.jsonl"), 64)
    preprocess(
        PreprocessConfig(inputs=[jsonl], tokenizer=model_dir, output_prefix=str(tmp_path / "d"), max_length=128),
        stream=io.StringIO(),
    )
    args = [
        f"model.path={model_dir}",
        f"data.prefix={tmp_path / 'd'}",
        "data.seq_length=256",
        "model.dtype=bf16",
        "model.backend=local",
        "train.steps=8",
        "optim.lr=3e-3",
        "optim.min_lr=3e-3",
        f"train.save_dir={tmp_path / 'run'}",
    ]
    losses = run_distributed(_sft_steps, 1, args, backend="nccl")[0]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_trainer_offload_frees_gradients_and_optimizer_state_on_the_gpu(model_dir):
    """rollout.colocate on a GPU: offload_trainer frees the gradient buffers and moves the optimizer
    state (Adam moments) to host memory, so the device holds less than the gradient buffers alone
    account for; the next update equals the one without offloading."""
    import torch

    from tests.distributed.test_trainer_offload import _two_updates

    plain = run_distributed(_two_updates, 1, model_dir, False, backend="nccl")[0]
    seen, metrics, weights = run_distributed(_two_updates, 1, model_dir, True, backend="nccl")[0]
    held, freed, during, _, back, zero, device_freed = seen
    assert during == 0 and back == held and zero
    assert device_freed > held, (device_freed, held)  # the optimizer state left the device too
    assert metrics["actor/loss"] == plain[1]["actor/loss"]
    for k in weights:
        assert torch.equal(weights[k], plain[2][k]), k


def test_router_replay_routes_the_update_on_the_gpu(moe_noaux_dir):  # noqa: F811 -- the shared fixture
    """rollout.router_replay on CUDA (NCCL, Megatron's MoE layers without Transformer Engine): the
    old-log-prob pass, the update's forward and the recompute inside its backward route to the
    engine's experts; ratio 1 on the first mini-batch and transformers' gradient with the experts
    forced (the CPU test's checks, tests/distributed/test_moe_actor.py, at GPU tolerances)."""
    from tests.distributed.test_moe_actor import _replayed_update, check_replayed_update

    results = run_distributed(
        _replayed_update, 1, moe_noaux_dir, ["model.recompute_granularity=full"], False, backend="nccl"
    )
    check_replayed_update(moe_noaux_dir, results, tol=5e-3, ratio_tol=1e-4)


def test_the_delta_loader_writes_only_changed_elements_on_the_gpu_and_checks_free_memory():
    """megatron_klear/rollout/in_server/sglang_delta.py on CUDA tensors, as in an SGLang server: a
    delta densified on the GPU and copied into a narrowed (fused q/k/v-like) GPU parameter writes
    only its changed elements; the free-memory check reads the device and refuses a bucket larger
    than what is free, before anything is received."""
    import torch

    from megatron_klear.rollout.in_server.sglang_delta import _check_memory, densified, nan_masked_copies
    from megatron_klear.rollout.servers.update_group import delta_segments, index_dtype

    dev = torch.device("cuda")
    fused = torch.zeros(8, 12, dtype=torch.bfloat16, device=dev)  # q and k side by side
    segments = delta_segments(["q"], ["bfloat16"], [[8, 6]], [3])
    positions = torch.tensor([0, 13, 47], dtype=index_dtype(48), device=dev)
    values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16, device=dev)
    ((_, delta, whole),) = list(densified(segments, [positions, values], {"q": [8, 6]}))
    assert not whole and delta.is_cuda
    with nan_masked_copies():
        fused[:, :6].copy_(delta)
    expected = torch.zeros(8, 12, dtype=torch.bfloat16)
    flat = torch.zeros(48, dtype=torch.bfloat16)
    flat[[0, 13, 47]] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    expected[:, :6] = flat.view(8, 6)
    assert torch.equal(fused.cpu(), expected)
    free, _ = torch.cuda.mem_get_info(dev)
    _check_memory(dev, 1 << 20)
    with pytest.raises(MemoryError, match="are free on cuda"):
        _check_memory(dev, free + (1 << 30))


def _relay_a_cuda_bucket(rank, world):
    """Rank 0 relays a CUDA bucket to rank 1 (both on GPU 0, gloo as in the product), rank 1 shares
    its device copy as CUDA IPC handles, and rank 0 (another process, as a server would be) maps
    them."""
    import torch

    from megatron_klear.rollout.in_server.shared_tensors import load_shared_tensors
    from megatron_klear.rollout.weight_sync.relay import BucketRelay
    from megatron_klear.rollout.weight_sync.sharing import bucket_layout, share_bucket

    torch.cuda.set_device(0)
    relay = BucketRelay({1: 1}, torch.device("cuda", 0))
    named = [
        ("model.norm.weight", torch.arange(96, dtype=torch.bfloat16, device="cuda")),
        ("lm_head.weight", torch.randn(7, 5, device="cuda").to(torch.bfloat16)),
    ]
    if rank == 1:
        relay.start()
        relay.join()
        return relay.received
    _, buffer = share_bucket(named)
    (handles,) = relay.send(bucket_layout(named)[0], buffer)[1]
    mapped = dict(load_shared_tensors(handles))  # rank 1's copy, through its CUDA IPC handles
    same = all(mapped[n].is_cuda and torch.equal(mapped[n], t) for n, t in named)
    del mapped
    relay.end()
    return same


def test_a_bucket_relayed_to_another_rank_is_mapped_from_its_gpu_copy():
    """rollout/weight_sync/relay.py's GPU path (a colocated job on several nodes): the bucket leaves
    rank 0's GPU as host memory, lands on the relay rank's GPU, and the handles that rank shares
    (CUDA IPC, from its receiving thread) map to exactly the sent tensors in another process."""
    same, received = run_distributed(_relay_a_cuda_bucket, 2)
    assert same is True and received == 1


def _nccl_communicator_memory(rank, world):
    """One NCCL rank: what its communicators hold before and after the first collective."""
    import torch
    import torch.distributed as dist

    from megatron_klear.training.comm_memory import communicator_memory, nccl_groups

    before = communicator_memory()
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return str(torch.__version__), before, communicator_memory(), len(nccl_groups())


def test_the_nccl_communicators_memory_is_read_after_the_first_collective():
    """training/comm_memory.py on a GPU (PyTorch 2.12+ with NCCL 2.29.7+): before any collective the
    default group's communicator does not exist (it holds nothing), after one it holds memory, part
    of it releasable. An older PyTorch or NCCL cannot say: the metric is then left out."""
    version, before, after, groups = run_distributed(_nccl_communicator_memory, 1, backend="nccl")[0]
    assert groups == 1
    if after is None:
        pytest.skip(f"PyTorch {version} or its NCCL has no memory_stats (2.12+ with NCCL 2.29.7+)")
    assert before == {"total": 0, "suspend": 0}, before
    assert after["total"] > 0 and 0 < after["suspend"] <= after["total"], after


def _nccl_suspend_and_resume(rank, world):
    """One NCCL rank: its default group suspended (memory released) and resumed (a collective works)."""
    import torch
    import torch.distributed as dist

    from megatron_klear.platform.device_facts import probe
    from megatron_klear.training.comm_memory import CommSuspension, communicator_memory, suspend_refusal

    why = suspend_refusal(probe())
    if why:
        return why, None
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)  # the communicator exists from here
    torch.cuda.synchronize()
    held = communicator_memory()
    free_before = torch.cuda.mem_get_info()[0]
    comms = CommSuspension()
    metrics = comms.suspend()
    free_suspended = torch.cuda.mem_get_info()[0]
    comms.resume()
    t.fill_(1.0)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return None, (held, metrics, free_suspended - free_before, float(t[0].item()))


def test_suspended_nccl_communicators_release_their_memory_and_work_after_resume():
    """training/comm_memory.py CommSuspension on a GPU (PyTorch 2.12+ with NCCL 2.29.7+: what
    rollout.suspend_nccl does to Megatron's groups from a colocated push to the next update): the
    releasable bytes come back to the device while suspended, and the group works again after."""
    why, out = run_distributed(_nccl_suspend_and_resume, 1, backend="nccl")[0]
    if why:
        pytest.skip(why)
    held, metrics, freed, value = out
    assert held["suspend"] > 0 and metrics["memory/nccl_released_gb"] == held["suspend"] / 1e9, (held, metrics)
    assert freed >= 0.5 * held["suspend"], (freed, held)  # (the driver rounds to its pages)
    assert value == 1.0  # world size 1: the all-reduce of ones is ones


def test_on_a_cuda_machine_the_fusions_compile_and_model_fusions_off_runs_them_eagerly():
    """platform/deferred_compile.py on a GPU machine: Megatron-Core's fused SwiGLU, called on CUDA
    tensors in a fresh process, is compiled by Inductor/Triton (one frame compiled) while the fusions
    are on, and runs eagerly (nothing compiled) after ``set_fusions(False)`` (``model.fusions=off``);
    the answers agree with the eager formula (its CPU twin: tests/test_compile_check.py)."""
    import json
    import subprocess
    import sys

    code = """
import json, torch, megatron_klear
from torch._dynamo.utils import counters
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import swiglu
from megatron_klear.platform import deferred_compile

x = torch.randn(300, 2 * 128, device="cuda")
a, b = torch.chunk(x, 2, -1)
want = torch.nn.functional.silu(a) * b
out = {"deferred": jit.jit_fuser is deferred_compile.compile_on_first_call}
deferred_compile.set_fusions(False)
eager = swiglu(x)
out["frames_off"] = sum(counters["frames"].values())
deferred_compile.set_fusions(True)
fused = swiglu(x)
out["frames_on"] = sum(counters["frames"].values())
out["eager_err"] = float((eager - want).abs().max())
out["fused_err"] = float((fused - want).abs().max())
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["deferred"] and out["frames_off"] == 0 and out["frames_on"] >= 1, out
    assert out["eager_err"] == 0.0 and out["fused_err"] < 1e-5, out
