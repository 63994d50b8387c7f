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
  The walk follows every function those loaders call that the files read define (module functions
  across the files, the class's own methods), reads tuple targets (``param_data, loaded_weight =
  ...``) and augmented assignments, and checks that ``weight_loader_v2`` (in files not read) is only
  the quantized methods' path.

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


# The loaders SGLang 0.5.23 hands a Qwen3 / Qwen3-MoE checkpoint tensor to, and every function they
# call that is defined in the files read (followed: module functions by name across the files,
# methods of the same class through ``self``), with each write into a parameter they make and each
# value the loaded tensor is rebound to (tuple targets included).
LOADER_PATHS = {
    "sglang/srt/layers/linear.py": {
        "ReplicatedLinear.weight_loader",
        "ColumnParallelLinear.weight_loader",
        "MergedColumnParallelLinear.weight_loader",
        "QKVParallelLinear.weight_loader",
        "RowParallelLinear.weight_loader",
    },
    "sglang/srt/layers/vocab_parallel_embedding.py": {"VocabParallelEmbedding.weight_loader"},
    "sglang/srt/layers/moe/fused_moe_triton/layer.py": {"FusedMoE.weight_loader"},
    "sglang/srt/model_loader/weight_utils.py": {"default_weight_loader"},
}
#: the other files whose functions the loaders call (their helpers are followed into them)
HELPER_FILES = ("sglang/srt/layers/utils/common.py",)
#: helpers the walk must reach (a walk that stopped following calls would find less and pass)
MUST_REACH = {
    "narrow_padded_param_and_loaded_weight",
    "reset_param_data_if_needed",
    "pad_or_narrow_weight",
    "adjust_scalar_to_fused_array",
    "_copy_weight_view_before_h2d",
    "FusedMoE._weight_loader_impl",
    "FusedMoE._load_w13",
    "FusedMoE._load_w2",
}
INPLACE = ("copy_", "fill_", "zero_", "index_copy_", "scatter_", "masked_scatter_", "index_put_", "add_", "mul_")
#: writes other than ``copy_(loaded_weight)`` (which the delta loader masks: the delta's unchanged
#: elements are NaN in the loaded tensor), and why each keeps a delta right or is never reached by one
OTHER_WRITES = {
    # padding beyond the checkpoint's rows or the shard's real size is zero whatever is loaded
    ("VocabParallelEmbedding.weight_loader", "fill_", "param[loaded_weight.shape[0]:].data", "0"),
    ("reset_param_data_if_needed", "zero_", "param_data.narrow(dim, start, length)", ""),
    (
        "FusedMoE._load_w13",
        "zero_",
        "expert_data.narrow(shard_dim, loaded_size, expert_data.shape[shard_dim] - loaded_size)",
        "",
    ),
    (
        "FusedMoE._load_w2",
        "zero_",
        "expert_data.narrow(shard_dim, loaded_size, expert_data.shape[shard_dim] - loaded_size)",
        "",
    ),
    # a one-element parameter: the sender always sends a 1-element tensor whole (tested below)
    ("default_weight_loader", "fill_", "param.data", "loaded_weight.item()"),
    # GGUF bookkeeping and quantized scales (quantized checkpoints, which the client refuses delta syncs to)
    ("ReplicatedLinear.weight_loader", "assign", "param.weight_type", "loaded_weight.item()"),
    ("ColumnParallelLinear.weight_loader", "assign", "param.weight_type", "loaded_weight.item()"),
    ("RowParallelLinear.weight_loader", "assign", "param.weight_type", "loaded_weight.item()"),
    ("VocabParallelEmbedding.weight_loader", "assign", "param.weight_type", "loaded_weight.item()"),
    (
        "MergedColumnParallelLinear.weight_loader",
        "assign",
        "param.shard_weight_type[loaded_shard_id]",
        "loaded_weight.item()",
    ),
    ("QKVParallelLinear.weight_loader", "assign", "param.shard_weight_type[loaded_shard_id]", "loaded_weight.item()"),
    ("FusedMoE._load_gguf_weight", "assign", "param.weight_type", "loaded_weight.item()"),
    ("FusedMoE._load_gguf_weight", "assign", "param.expert_data_map[key]", "loaded_weight"),
    ("FusedMoE._load_per_tensor_weight_scale", "assign", "param_data[expert_id]", "loaded_weight"),
    ("FusedMoE._load_per_tensor_weight_scale", "assign", "param_data[expert_id][idx]", "loaded_weight"),
    ("FusedMoE._load_single_value", "assign", "param_data[expert_id]", "loaded_weight"),
    (
        "FusedMoE._maybe_load_fp8_shared_expert_as_fp4",
        "assign",
        "self._pending_fp8_shared_scales[key]",
        "loaded_weight",
    ),
    (
        "FusedMoE._maybe_load_fp8_shared_expert_as_fp4",
        "assign",
        "self._pending_fp8_shared_weights[key]",
        "loaded_weight",
    ),
}
#: every value ``loaded_weight`` is rebound to on those paths: each maps NaN to NaN at the same
#: element (a view, a narrow, a transpose, a reshape, a device move or copy, a constant scale, zero
#: padding: ``torch.zeros_like`` of a narrow of length 0, when a shard holds none of the tensor), or
#: is a quantized path's (a scale's first element, GGUF)
REBINDINGS = {
    "loaded_weight.narrow(output_dim, start_idx, shard_size)",
    "loaded_weight.narrow(input_dim, start_idx, shard_size)",
    "loaded_weight.narrow(shard_dim, loaded_shard_size * self.moe_tp_rank, loaded_shard_size)",
    "loaded_weight.narrow(dim, weight_start, actual_shard_size)",
    "loaded_weight.narrow(0, start_idx, shard_size).clone()",
    "torch.zeros_like(param_data.narrow(dim, param_data_start, actual_shard_size))",
    "loaded_weight.reshape(1)",
    "loaded_weight[:1]",
    "loaded_weight[0]",
    "loaded_weight.transpose(-2, -1)",
    "loaded_weight.to(param.data.device)",
    "loaded_weight * 0.5",
    "loaded_weight * 2.0",
    "_maybe_copy_weight_view_before_h2d(loaded_weight)",
    "pad_or_narrow_weight(loaded_weight, output_dim, start_idx, shard_size)",
    "pad_or_narrow_weight(loaded_weight, input_dim, start_idx, shard_size)",
    "pad_loaded_weight(loaded_weight, param.output_dim, output_sizes)",
    "pad_loaded_weight(loaded_weight, param.output_dim, shard_block_sizes)",
    "adjust_scalar_to_fused_array(param_data, loaded_weight, 0)",
    "adjust_scalar_to_fused_array(param_data, loaded_weight, loaded_shard_id)",
    "narrow_padded_param_and_loaded_weight(param_data, loaded_weight, 0, start_idx, output_dim, shard_size, not "
    "self.use_presharded_weights)",
    "narrow_padded_param_and_loaded_weight(param_data, loaded_weight, 0, start_idx, output_dim, shard_size, not "
    "use_bitsandbytes_4bit and (not self.use_presharded_weights))",
    "narrow_padded_param_and_loaded_weight(param_data, loaded_weight, 0, start_idx, input_dim, shard_size)",
    "narrow_padded_param_and_loaded_weight(expert_data, loaded_weight, start, weight_start, shard_dim, shard_size, "
    "not self.use_presharded_weights)",
    "narrow_padded_param_and_loaded_weight(expert_data, loaded_weight, 0, weight_start, shard_dim, shard_size, not "
    "self.use_presharded_weights)",
    "loaded_weight.t().contiguous() if method.__class__.__name__ in ['CompressedTensorsWNA16MarlinMoE', "
    "'CompressedTensorsWNA16MoE', 'CompressedTensorsWNA16TritonMoE'] and 'zero' not in weight_name else loaded_weight",
}


def _definitions():
    """``({name: (name, function, None)}, {(class, name): (qualname, method, class)})`` of the
    loaders' files and :data:`HELPER_FILES`."""
    funcs, methods = {}, {}
    for rel in (*LOADER_PATHS, *HELPER_FILES):
        for node in _source(rel).body:
            if isinstance(node, ast.FunctionDef):
                funcs.setdefault(node.name, (node.name, node, None))
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef):
                        methods[(node.name, f.name)] = (f"{node.name}.{f.name}", f, node.name)
    return funcs, methods


def _names(target):
    """The assigned names and subscripts of a target, through tuples (``a, b = ...``)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            yield from _names(e)
    else:
        yield target


def _reached():
    """``{qualname: function}``: the loaders and every function they reach."""
    funcs, methods = _definitions()
    todo = [methods[tuple(w.split("."))] if "." in w else funcs[w] for ws in LOADER_PATHS.values() for w in ws]
    seen = {}
    while todo:
        name, fn, cls = todo.pop()
        if name in seen:
            continue
        seen[name] = fn
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if isinstance(f, ast.Name) and f.id in funcs:
                todo.append(funcs[f.id])
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                if (cls, f.attr) in methods:
                    todo.append(methods[(cls, f.attr)])
    return seen


def test_qwen3s_weight_loaders_write_what_they_are_given_only_through_copy():
    reached = _reached()
    assert MUST_REACH <= set(reached), sorted(MUST_REACH - set(reached))
    writes, rebinds = set(), set()
    for name, fn in reached.items():
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in INPLACE:
                arg = ast.unparse(n.args[0]) if n.args else ""
                writes.add((name, n.func.attr, ast.unparse(n.func.value), arg))
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                value = ast.unparse(n.value)
                for t in (u for tgt in (n.targets if isinstance(n, ast.Assign) else [n.target]) for u in _names(tgt)):
                    if isinstance(t, ast.Name) and t.id == "loaded_weight":
                        rebinds.add(value)
                    elif isinstance(t, (ast.Subscript, ast.Attribute)) and "loaded_weight" in value:
                        kind = "augassign" if isinstance(n, ast.AugAssign) else "assign"
                        writes.add((name, kind, ast.unparse(t), value))
    copies = {w for w in writes if w[1] == "copy_" and w[3] == "loaded_weight"}  # (masked by the delta loader)
    assert writes - copies == OTHER_WRITES, sorted(writes - copies ^ OTHER_WRITES)
    assert rebinds == REBINDINGS, sorted(rebinds ^ REBINDINGS)
    # weight_loader_v2 (BasevLLMParameter's loaders, in files not read here) is taken only by the
    # quantized methods SGLang lists; an unquantized Qwen3 layer never reaches it
    linear = _source("sglang/srt/layers/linear.py")
    (listed,) = [
        n.value
        for n in linear.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "WEIGHT_LOADER_V2_SUPPORTED"
    ]
    methods = {ast.literal_eval(e) for e in listed.elts}
    assert methods and not any(m.startswith("Unquantized") for m in methods), sorted(methods)
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
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "loaded_weight" for tgt in n.targets for t in _names(tgt))
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
