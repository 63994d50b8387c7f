"""Conversion round trip, logits parity at TP/PP, conversion errors, the CPU compatibility layer.

Each test spawns fresh gloo processes (Megatron's parallel state is process-global).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.helper import run_distributed

ROOT = Path(__file__).resolve().parents[2]

TOL = 1e-4


# ---- functions run inside the spawned ranks --------------------------------------------------------
def _convert(rank, world, hf_dirs, out_root):
    from megatron_klear.checkpoint.convert import hf_to_megatron, megatron_to_hf

    out = {}
    for name, hf in hf_dirs.items():
        # pieces of 8 KB (the tensors are 10-130 KB): every parity test below loads a checkpoint cut
        # finer than any training run's, at TP/PP layouts that reshard it
        mg = hf_to_megatron(
            hf, os.path.join(out_root, f"mg-{name}"), tp=2, pp=2, piece_bytes=8192, workers=2, progress=False
        )
        back = megatron_to_hf(mg, os.path.join(out_root, f"hf-{name}"), max_shard_bytes=50_000, progress=False)
        out[name] = (mg, back)
    return out


def _parity(rank, world, tp, pp, pairs, seq_len=19):
    from megatron_klear.checkpoint.parity import check_parity

    return [check_parity(hf, ckpt_dir=ckpt, tp=tp, pp=pp, seq_len=seq_len) for hf, ckpt in pairs]


def _conversion_errors(rank, world, root, good_hf):
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_klear.checkpoint.convert import hf_to_megatron, megatron_to_hf

    def attempt(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    def variant(name, edit_tensors=None, edit_config=None):
        d = os.path.join(root, name)
        shutil.copytree(good_hf, d)
        if edit_tensors:
            index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
            for shard in sorted(set(index["weight_map"].values())):
                os.remove(os.path.join(d, shard))
            os.remove(os.path.join(d, "model.safetensors.index.json"))
            tensors = {}
            for shard in sorted(set(index["weight_map"].values())):
                tensors.update(load_file(os.path.join(good_hf, shard)))
            edit_tensors(tensors)
            save_file(tensors, os.path.join(d, "model.safetensors"))
        if edit_config:
            cfg = json.load(open(os.path.join(d, "config.json")))
            edit_config(cfg)
            json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        return d

    out = os.path.join(root, "out")
    results = {
        "no_dir": attempt(hf_to_megatron, os.path.join(root, "nope"), out, progress=False),
        "unknown_key": attempt(
            hf_to_megatron, variant("unknown", lambda t: t.update(extra=torch.zeros(2))), out, progress=False
        ),
        "missing_key": attempt(
            hf_to_megatron,
            variant("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
            out,
            progress=False,
        ),
        "bad_shape": attempt(
            hf_to_megatron,
            variant("shape", lambda t: t.update({"model.layers.0.self_attn.k_norm.weight": torch.ones(5)})),
            out,
            progress=False,
        ),
        "bad_arch": attempt(
            hf_to_megatron, variant("arch", edit_config=lambda c: c.update(model_type="mamba")), out, progress=False
        ),
        "bad_tp": attempt(hf_to_megatron, good_hf, out, tp=4, progress=False),
        "not_a_ckpt": attempt(megatron_to_hf, good_hf, out, progress=False),
    }
    shard_dir = variant("missing_shard")
    os.remove(os.path.join(shard_dir, "model-00002-of-00008.safetensors"))
    results["missing_shard"] = attempt(hf_to_megatron, shard_dir, out, progress=False)
    results["leftovers"] = sorted(n for n in os.listdir(root) if n.startswith(".") or n == "out")
    return results


def _cpu_compat(rank, world):
    import torch

    from megatron_klear.platform import cpu_compat

    cpu_compat.activate()
    seen = {
        "zeros": torch.zeros(2, device="cuda").device.type,
        "int_device": torch.empty(1, device=torch.cuda.current_device()).device.type,
        "to": torch.ones(1).to("cuda:0").device.type,
        "cuda": torch.ones(1).cuda().device.type,
        "type": torch.ones(1).type(),
        "pinned": torch.tensor([1], pin_memory=True).device.type,
        "stream": torch.cuda.current_stream().wait_stream(None),
        "sync": torch.cuda.synchronize(),
        "is_available": torch.cuda.is_available(),
    }
    cpu_compat.deactivate()
    seen["type_after"] = torch.ones(1).type()
    try:
        torch.zeros(1, device="cuda")
        seen["cuda_after"] = "allocated"
    except Exception:  # noqa: BLE001 - no CUDA: the real error comes back once deactivated
        seen["cuda_after"] = "error"
    return seen


# ---- tests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tiny_hf, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("converted"))
    return run_distributed(_convert, 1, tiny_hf, root)[0]


def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_hf, converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_klear.checkpoint.hf_io import HFReader

    for name, src in tiny_hf.items():
        mg, back = converted[name]
        a, b = HFReader(src), HFReader(back)
        assert a.keys() == b.keys()
        for key in a.keys():
            x, y = a.get(key), b.get(key)
            assert x.dtype == y.dtype and torch.equal(x, y), key
        index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
        assert len(set(index["weight_map"].values())) > 1  # sharded, with an index
        m1 = AutoModelForCausalLM.from_pretrained(src).eval()
        m2 = AutoModelForCausalLM.from_pretrained(back).eval()
        tokens = torch.randint(0, 389, (1, 11))
        with torch.no_grad():
            assert torch.equal(m1(tokens).logits, m2(tokens).logits)
        tok = AutoTokenizer.from_pretrained(back)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
            "<|im_start|>user"
        )
        manifest = json.load(open(os.path.join(mg, "manifest.json")))
        assert manifest["suggested_parallel"] == {"tp": 2, "pp": 2}
        assert not [n for n in os.listdir(os.path.dirname(mg)) if n.startswith(".")]


def _pairs(tiny_hf, converted):
    return [(tiny_hf[n], converted[n][0]) for n in ("untied", "tied")]


def test_parity_tp1(tiny_hf, converted):
    pairs = _pairs(tiny_hf, converted) + [(tiny_hf["untied"], None)]  # also HF loaded directly
    diffs = run_distributed(_parity, 1, 1, 1, pairs)[0]
    assert max(diffs) < TOL, diffs


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parity_two_ranks(tiny_hf, converted, tp, pp):
    diffs = run_distributed(_parity, 2, tp, pp, _pairs(tiny_hf, converted))
    assert all(d == diffs[0] for d in diffs)  # every rank reports the same number
    assert max(diffs[0]) < TOL, diffs


def test_parity_tp2_pp2(tiny_hf, converted):
    diffs = run_distributed(_parity, 4, 2, 2, _pairs(tiny_hf, converted))
    assert max(diffs[0]) < TOL, diffs


def test_conversion_errors_are_clear_and_leave_nothing(tiny_hf, tmp_path):
    r = run_distributed(_conversion_errors, 1, str(tmp_path), tiny_hf["untied"])[0]
    assert "nope: no config.json" in r["no_dir"]
    assert "unknown tensors" in r["unknown_key"] and "'extra'" in r["unknown_key"]
    assert "missing tensors" in r["missing_key"] and "model.layers.1.mlp.up_proj.weight" in r["missing_key"]
    assert "model.layers.0.self_attn.k_norm.weight" in r["bad_shape"] and "(5,)" in r["bad_shape"]
    assert "unsupported model_type 'mamba'" in r["bad_arch"]
    assert "--tp 4 must divide num_key_value_heads=2" in r["bad_tp"]
    assert "no hf_config.json" in r["not_a_ckpt"]
    assert "model-00002-of-00008.safetensors" in r["missing_shard"] and "missing" in r["missing_shard"]
    assert r["leftovers"] == [], r["leftovers"]  # no output, no temporary directories


def test_cpu_compat_redirects_only_while_active():
    seen = run_distributed(_cpu_compat, 1)[0]
    assert {seen[k] for k in ("zeros", "int_device", "to", "cuda", "pinned")} == {"cpu"}
    assert seen["type"] == "torch.cuda.FloatTensor" and seen["type_after"] == "torch.FloatTensor"
    assert seen["is_available"] is False
    assert seen["cuda_after"] == "error"


@pytest.fixture(scope="module")
def other_families(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_model

    base = tmp_path_factory.mktemp("families")
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return {
        "qwen2": make_tiny_model(str(base / "qwen2"), model_type="qwen2", seed=4),
        "llama3": make_tiny_model(
            str(base / "llama3"), model_type="llama", rope_scaling=llama3, max_position_embeddings=65536, seed=5
        ),
        # Klear's 64K evaluation: YaRN factor 2.5 over the original positions (scaled down here)
        "qwen3_yarn": make_tiny_model(
            str(base / "yarn"),
            model_type="qwen3",
            max_position_embeddings=640,
            seed=6,
            rope_scaling={"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 256},
        ),
    }


def test_parity_qwen2_llama3_and_yarn_tp2(other_families):
    """Qwen2.5-style q/k/v biases, Llama-3.1 RoPE scaling and Qwen3 with YaRN, through the same
    mapping."""
    pairs = [(other_families[k], None) for k in ("qwen2", "llama3", "qwen3_yarn")]
    # 200 tokens: long enough for the scaled low frequencies to matter (without the scaling the
    # logits differ by ~0.1)
    diffs = run_distributed(_parity, 2, 2, 1, pairs, 200)
    assert max(diffs[0]) < TOL, diffs


def test_fp8_without_transformer_engine_is_refused():
    from megatron_klear.models.builder import ModelOptions, have_te, resolve_backend

    if have_te():
        pytest.skip("Transformer Engine is installed")
    for opts in (ModelOptions(fp8="hybrid"), ModelOptions(backend="te")):
        with pytest.raises(
            ImportError, match=r"pip install --no-build-isolation -e '\.\[gpu\]' -c requirements/gpu-constraints\.txt"
        ):
            resolve_backend(opts)
    assert resolve_backend(ModelOptions()) == "local"


def test_a_world_of_one_leaves_the_environment_to_its_children(tmp_path):
    # A plain `python` process that starts torch.distributed (a tool, a test, the demo's parent) must
    # neither publish RANK/MASTER_PORT in os.environ nor hold a TCP store a child would then try to join
    # or re-bind: the quick demo once died with EADDRINUSE because an earlier in-process world of one
    # had leaked MASTER_PORT into the environment its subprocesses inherited.
    script = tmp_path / "one.py"
    script.write_text(
        "import os, subprocess, sys\n"
        "from megatron_klear.platform.distributed import init_parallel\n"
        "init_parallel()\n"
        "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')\n"
        "leaked = sorted(k for k in keys if k in os.environ)\n"
        "assert not leaked, leaked\n"
        "if len(sys.argv) == 1:\n"
        "    subprocess.run([sys.executable, __file__, 'child'], check=True)\n"
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(3)\n"
        "dist.all_reduce(t)\n"
        "assert t.tolist() == [1.0, 1.0, 1.0] and dist.get_world_size() == 1\n"
        "print('ok', sys.argv[1:])\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[:2] == ["ok ['child']", "ok []"]


@pytest.mark.parametrize("cuda,env,spawned", [(False, None, False), (True, None, True), (False, "spawn", True)])
def test_the_test_helper_spawns_its_ranks_on_a_cuda_machine(monkeypatch, cuda, env, spawned):
    """The helper's warm fork server cannot give its children CUDA ("Cannot re-initialize CUDA in
    forked subprocess"): on a machine with CUDA every world spawns, gloo ones included."""
    import torch

    from tests.distributed import helper

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if env:
        monkeypatch.setenv("KLEAR_TEST_START_METHOD", env)
    else:
        monkeypatch.delenv("KLEAR_TEST_START_METHOD", raising=False)
    context = helper._context("gloo")
    assert (getattr(context, "get_start_method", lambda: "fork-server")() == "spawn") is spawned
