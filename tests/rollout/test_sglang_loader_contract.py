"""What the delta loader (megatron_klear/rollout/in_server/sglang_delta.py) relies on in SGLang
0.5.23, read from the pinned wheel's sources (``make venv`` extracts them: tools/fetch_sglang_contract.py)
without running SGLang, which needs CUDA:

- how a custom loader is called and where the update groups live: the loader finds the server's
  table of groups in its caller's frame and marks a group there instead of raising (a raise ends
  SGLang's scheduler: ``update_weights_from_tensor`` has no handler, while the receive of
  ``update_weights_from_distributed`` answers ``Group ... not in [...]`` gracefully);
- how Qwen3's and Qwen3-MoE's weight loaders write what they are given: the delta loader hands them
  a full-shape tensor of NaN with the changed elements written in, and relies on every write being a
  ``Tensor.copy_`` from that tensor (which it masks, and which raises on a shape mismatch), reached
  through element-wise value maps only (views, narrows, transposes, moves, scaling by a constant).

The sets below are what 0.5.23 holds, each with why it keeps the masking right: an SGLang upgrade that
changes them fails here, for review, before it can write NaN into a server's weights.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch

from tests.rollout.sglang_contract import CONTRACT_DIR


def _source(rel: str) -> ast.Module:
    path = os.path.join(CONTRACT_DIR, rel)
    if not os.path.isfile(path):
        pytest.fail(f"SGLang's {rel} is missing ({path}): run make venv (tools/fetch_sglang_contract.py)")
    with open(path) as f:
        return ast.parse(f.read())


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return f
    if cls == "":
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
    raise AssertionError(f"{cls}.{name} not found")


def _calls(fn) -> set:
    return {ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)}


def _handled(fn) -> bool:
    """Whether ``fn`` catches exceptions anywhere (a ``try`` with an ``except Exception``)."""
    return any(
        isinstance(n, ast.ExceptHandler) and n.type is not None and ast.unparse(n.type) == "Exception"
        for n in ast.walk(fn)
    )


def test_a_custom_loader_is_called_where_it_can_mark_the_servers_update_group():
    runner = _source("sglang/srt/model_executor/model_runner_components/weight_updater.py")
    # the loader is called by the WeightUpdater's own method, whose ``self`` holds the groups by name
    from_tensor = _method(runner, "WeightUpdater", "update_weights_from_tensor")
    assert "custom_loader(self.get_model(), named_tensors)" in _calls(from_tensor)
    init = _method(runner, "WeightUpdater", "init_weights_update_group")
    assert any(
        isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self._model_update_group[group_name]"
        for n in ast.walk(init)
    )
    # a name missing from that table is refused with the table's keys, which carry the mark
    receive = _method(runner, "WeightUpdater", "receive_weights_from_distributed")
    asserts = [n for n in ast.walk(receive) if isinstance(n, ast.Assert)]
    assert asserts and ast.unparse(asserts[0].test) == "group_name in self._model_update_group"
    message = ast.unparse(asserts[0].msg)
    assert "not in" in message and "list(self._model_update_group.keys())" in message
    # ... and that refusal is answered (the scheduler catches the receive's exception), while an
    # exception of a custom loader is not (the scheduler's loop dies of it)
    scheduler = _source("sglang/srt/managers/scheduler_components/weight_updater.py")
    assert _handled(_method(scheduler, "SchedulerWeightUpdaterManager", "update_weights_from_distributed"))
    assert not _handled(_method(scheduler, "SchedulerWeightUpdaterManager", "update_weights_from_tensor"))
    assert not _handled(from_tensor)


def test_the_marked_table_reads_back_through_sglangs_refusal():
    """The loader's mark, formatted as SGLang formats the refusal, is what the client reads."""
    from megatron_klear.rollout.in_server.sglang_delta import FAILED_MARK, failed_load

    table = {"g_r1" + FAILED_MARK + "MemoryError: densifying this bucket takes 9 MiB)": object(), "other": 1}
    refusal = f"Failed to receive weights: Group g_r1 not in {list(table.keys())}. Please call ..."
    assert failed_load(refusal, "g_r1") == next(iter(table))
    assert failed_load(refusal, "g") is None  # another group's mark is not this one's
    assert failed_load(f"Group g_r1 not in {['other']}.", "g_r1") is None  # restarted: no mark
    # a reason with brackets of its own: gloo's, when a peer of the group died mid-receive (read as
    # "no group" before: the live server taken for a restarted one and dropped from the fleet)
    gloo = (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:16275. This is typically caused by a remote worker crashing. GLHF! \U0001f3d6\ufe0f)"
    )
    table = {"other": 1, "klear_weights" + FAILED_MARK + gloo: object()}
    refusal = f"Failed to receive weights: Group klear_weights not in {list(table.keys())}. Please call ..."
    assert failed_load(refusal, "klear_weights") == list(table)[1]


# The writes into parameters on the unquantized paths of Qwen3 / Qwen3-MoE, and each rebinding of
# the loaded tensor before them (0.5.23). Writes: (method, target, what is written).
LOADER_PATHS = {
    "sglang/srt/layers/linear.py": {
        "ReplicatedLinear.weight_loader",
        "ColumnParallelLinear.weight_loader",
        "MergedColumnParallelLinear.weight_loader",
        "QKVParallelLinear.weight_loader",
        "RowParallelLinear.weight_loader",
    },
    "sglang/srt/layers/vocab_parallel_embedding.py": {"VocabParallelEmbedding.weight_loader"},
    "sglang/srt/layers/moe/fused_moe_triton/layer.py": {
        "FusedMoE.weight_loader",
        "FusedMoE._weight_loader_physical",
        "FusedMoE._weight_loader_impl",
        "FusedMoE._load_w13",
        "FusedMoE._load_w2",
    },
    "sglang/srt/model_loader/weight_utils.py": {"default_weight_loader"},
}
#: writes other than ``copy_(loaded_weight)``, and why each keeps a delta right
OTHER_WRITES = {
    # the vocabulary's padding rows (beyond the checkpoint's rows) are zero whatever is loaded
    ("VocabParallelEmbedding.weight_loader", "fill_", "param[loaded_weight.shape[0]:].data", "0"),
    # a one-element parameter: the sender always sends a 1-element tensor whole (tested below)
    ("default_weight_loader", "fill_", "param.data", "loaded_weight.item()"),
    # GGUF shard bookkeeping (quantized checkpoints, which the client refuses delta syncs to)
    (
        "MergedColumnParallelLinear.weight_loader",
        "assign",
        "param.shard_weight_type[loaded_shard_id]",
        "loaded_weight.item()",
    ),
    ("QKVParallelLinear.weight_loader", "assign", "param.shard_weight_type[loaded_shard_id]", "loaded_weight.item()"),
}
#: every value ``loaded_weight`` is rebound to on those paths: each maps NaN to NaN at the same
#: element (a view, a narrow, a transpose, a reshape, a device move, a constant scale, zero padding)
REBINDINGS = {
    "loaded_weight.narrow(output_dim, start_idx, shard_size)",
    "loaded_weight.narrow(input_dim, start_idx, shard_size)",
    "loaded_weight.narrow(shard_dim, loaded_shard_size * self.moe_tp_rank, loaded_shard_size)",
    "loaded_weight.reshape(1)",
    "loaded_weight[:1]",
    "loaded_weight.transpose(-2, -1)",
    "loaded_weight.to(param.data.device)",
    "loaded_weight * 0.5",
    "loaded_weight * 2.0",
    "_maybe_copy_weight_view_before_h2d(loaded_weight)",
    "pad_or_narrow_weight(loaded_weight, output_dim, start_idx, shard_size)",
    "pad_or_narrow_weight(loaded_weight, input_dim, start_idx, shard_size)",
    "loaded_weight.t().contiguous() if method.__class__.__name__ in ['CompressedTensorsWNA16MarlinMoE', "
    "'CompressedTensorsWNA16MoE', 'CompressedTensorsWNA16TritonMoE'] and 'zero' not in weight_name else loaded_weight",
}


def _loader_functions():
    for rel, wanted in LOADER_PATHS.items():
        tree = _source(rel)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                yield node.name, node
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f"{node.name}.{f.name}" in wanted:
                        yield f"{node.name}.{f.name}", f


def test_qwen3s_weight_loaders_write_what_they_are_given_only_through_copy():
    found, writes, rebinds = set(), set(), set()
    for name, fn in _loader_functions():
        found.add(name)
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_"):
                if n.func.attr in ("copy_", "fill_", "index_copy_", "scatter_", "masked_scatter_", "index_put_"):
                    writes.add((name, n.func.attr, ast.unparse(n.func.value), ast.unparse(n.args[0])))
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name) and t.id == "loaded_weight":
                        rebinds.add(ast.unparse(n.value))
                    elif (isinstance(t, ast.Subscript) or (isinstance(t, ast.Attribute) and t.attr == "data")) and (
                        "loaded_weight" in ast.unparse(n.value)
                    ):
                        writes.add((name, "assign", ast.unparse(t), ast.unparse(n.value)))
    assert found == set().union(*({f for f in v} for v in LOADER_PATHS.values()))
    copies = {w for w in writes if w[1] == "copy_"}
    assert all(w[3] == "loaded_weight" for w in copies), sorted(copies)
    assert writes - copies == OTHER_WRITES
    assert rebinds == REBINDINGS
    # the models hand each checkpoint tensor to those loaders as it is
    for rel, cls in (
        ("sglang/srt/models/qwen3.py", "Qwen3ForCausalLM"),
        ("sglang/srt/models/qwen3_moe.py", "Qwen3MoeForCausalLM"),
    ):
        fn = _method(_source(rel), cls, "load_weights")
        uses = {
            ast.unparse(n.func)
            for n in ast.walk(fn)
            if isinstance(n, ast.Call) and any(isinstance(a, ast.Name) and a.id == "loaded_weight" for a in n.args)
        }
        assert uses == {"weight_loader"}, (rel, uses)
        assert not any(
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "loaded_weight" for t in n.targets)
            for n in ast.walk(fn)
        ), rel


def test_a_one_element_tensor_always_goes_whole():
    """default_weight_loader fills a one-element parameter from ``loaded_weight.item()`` (a NaN
    would be written): the sender never sends such a tensor as changes."""
    from megatron_klear.rollout.servers.update_group import DENSE
    from megatron_klear.rollout.weight_sync.delta import DeltaImages

    images = DeltaImages()
    for dtype in (torch.bfloat16, torch.float32):
        images.begin()
        images.encode([("s", torch.ones(1, dtype=dtype)), ("t", torch.ones(()).to(dtype))])
        images.commit()
        images.begin()
        counts, pieces, _, _ = images.encode(
            [("s", torch.full((1,), 2.0, dtype=dtype)), ("t", torch.tensor(3.0, dtype=dtype))]
        )
        assert counts == [DENSE, DENSE] and [p.tolist() for p in pieces] == [[2.0], 3.0]


def test_the_loader_brings_little_into_sglangs_scheduler():
    """Importing the loader (SGLang imports it in every scheduler process) loads torch and the
    update group's module, not the trainer's client side (HTTP clients, engines, the fleet)."""
    import subprocess
    import sys

    code = (
        "import sys; import megatron_klear.rollout.in_server.sglang_delta; "
        "kinds = ('megatron_klear', 'httpx', 'requests', 'transformers'); "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(kinds))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert set(out.stdout.split()) == {
        "megatron_klear",
        "megatron_klear.platform",
        "megatron_klear.platform.deferred_compile",  # (standard library only; inert without megatron.core)
        "megatron_klear.platform.dtypes",
        "megatron_klear.platform.quiet",
        "megatron_klear.rollout",
        "megatron_klear.rollout.in_server",
        "megatron_klear.rollout.in_server.sglang_delta",
        "megatron_klear.rollout.servers",
        "megatron_klear.rollout.servers.update_group",
    }, out.stdout
