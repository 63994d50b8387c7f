"""Checkpoint conversion cost: HF -> Megatron (torch_dist) -> HF for a Qwen3-0.6B-shaped checkpoint,
as a ratio to a plain safetensors load + save of the same bytes, measured in the same run.

    python benchmarks/convert.py                     # single-file and 256 MB-shard layouts
    python benchmarks/convert.py --shard-mb 0        # one model.safetensors only (Qwen3-0.6B's layout)
    python benchmarks/convert.py --workdir /tmp --keep
    python benchmarks/convert.py --scaling           # Qwen3 0.6B, 1.7B, 4B, 8B and an MoE shape (~40 min,
                                                     # ~55 GB of disk): memory, bytes written, time, and
                                                     # the extrapolation to 32B, 30B-A3B, 235B-A22B

The checkpoint has Qwen3-0.6B's shapes (hidden 1024, intermediate 3072, 28 layers, 16 query / 8 KV
heads of 128, vocabulary 151,936, tied embeddings, bf16) and random weights. It is written tensor by
tensor straight to safetensors (building the transformers model would cost 2.4 GB of float32 just to
set the benchmark up); its ``config.json`` is the one ``transformers.Qwen3Config`` writes, and the
verify phase loads it back with ``AutoConfig``. Like ``save_pretrained`` of a tied model, the files
hold no ``lm_head.weight``.

For each shard layout these phases run, each in a fresh child process (so no phase inherits
another's heap, imports or allocator state):

- ``baseline``: ``safetensors.torch.load_file`` of every shard + ``save_file`` into a new directory
  (the plain load + save of the same bytes; every ratio is against this row);
- ``baseline_fsync``: the same with each file fsync'ed (context only: the torch_dist writer fsyncs
  its files, ``save_file`` does not);
- ``to_megatron``: ``hf_to_megatron`` (bf16, TP=1, PP=1);
- ``to_hf``: ``megatron_to_hf`` into shards capped at the source's shard size;
- ``verify`` (not timed): both config.json files load in transformers as Qwen3 with 0.6B's sizes,
  and every tensor of the round trip equals the source bit for bit, shard by shard.

Times: ``call`` is measured inside the child around the call alone, after the imports (a first
call in the process: it includes the converter's process-group bring-up and lazy imports);
``process`` is the child's wall time from start to exit (interpreter start and imports included).
Every input is read once just before its phase, so each phase starts with its input in the page
cache (24 GiB machine): the figures are CPU- and memory-bound, not disk-bound.

Memory, per phase:

- ``peak RSS``: the child's resident-set high-water mark (``ru_maxrss`` from ``wait4``; exact, child
  process only). RSS counts the file pages mapped into the process (``load_file`` maps the
  safetensors files) as well as anonymous memory; mapped file pages are page cache, which the
  kernel can drop and re-read under pressure.
- ``peak anon``: anonymous memory (heap, tensor data: memory that must really exist), summed over
  the child and every process it starts (none today: the converter's writers are threads) as
  ``Pss_Anon`` from ``/proc/<pid>/smaps_rollup``, so pages a fork shares are counted once; polled
  every 10 ms from the parent (a spike shorter than that can be missed). ``anon above floor``
  subtracts the child's ``RssAnon`` after its imports, before the call (torch alone ~0.14 GiB, with
  Megatron-Core ~0.27 GiB).
- ``peak PSS``: all resident memory of the process tree (anonymous + mapped file pages), shared
  pages divided among the processes that map them; polled the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)
# Qwen3 shapes (the Hub's config.json), random weights; "moe" is Qwen3-30B-A3B's layer (128 experts
# of width 768) with 4 of its 48 layers, the large MoE models only in the extrapolation.
_QWEN3 = dict(max_position_embeddings=40960, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645, head_dim=128)
SHAPES = {
    "0.6B": QWEN3_0_6B,
    "1.7B": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "4B": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "8B": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "moe": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
}
EXTRAPOLATE = {  # not built: their bytes from the same tensor list
    "32B": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "30B-A3B": dict(SHAPES["moe"], num_hidden_layers=48),
    "235B-A22B": dict(
        SHAPES["moe"], hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, moe_intermediate_size=1536
    ),
}
SCALING = ("0.6B", "1.7B", "4B", "8B", "moe")
HUB_SHARD = 4 * 1000**3  # the Hub's Qwen3 checkpoints come in shards of about 4 GB
GiB = 1024**3
MiB = 1024**2
UNLIMITED_SHARD = 50 * 10**9  # transformers' save_pretrained default (one file for this model)


# ------------------------------------------------------------------------------------------------
# Child phases (each runs in its own process; prints one JSON line prefixed with RESULT)
# ------------------------------------------------------------------------------------------------


def _tensor_specs(cfg: dict) -> list:
    """(name, shape) of every HF tensor, in the order transformers' state_dict lists them."""
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    specs = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", (nq * d, h)),
            (p + "self_attn.k_proj.weight", (nkv * d, h)),
            (p + "self_attn.v_proj.weight", (nkv * d, h)),
            (p + "self_attn.o_proj.weight", (h, nq * d)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
        ]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # (transformers 5 saves the latter)
        if experts:
            e, m = experts, cfg["moe_intermediate_size"]
            specs.append((p + "mlp.gate.weight", (e, h)))
            for j in range(e):
                q = f"{p}mlp.experts.{j}."
                specs += [
                    (q + "gate_proj.weight", (m, h)),
                    (q + "up_proj.weight", (m, h)),
                    (q + "down_proj.weight", (h, m)),
                ]
        else:
            specs += [
                (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)),
            ]
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    specs.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return specs


def _plan_shards(specs: list, max_shard_bytes: int) -> list:
    """Group tensors into shards the way save_pretrained does: in order, a new shard when full."""
    shards, current, size = [], [], 0
    for name, shape in specs:
        n = 2
        for s in shape:
            n *= s
        if current and size + n > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += n
    if current:
        shards.append(current)
    return shards


def phase_make(args) -> dict:
    """Write the random bf16 checkpoint shard by shard (one shard's tensors in memory at a time)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3MoeConfig

    shape = SHAPES[args.shape]
    moe = bool(shape.get("num_experts"))
    config = (Qwen3MoeConfig if moe else Qwen3Config)(
        **shape, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, dtype="bfloat16"
    )
    config.architectures = ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    cfg = config.to_dict()
    specs = _tensor_specs(cfg)
    cap = args.max_shard_bytes
    shards = _plan_shards(specs, cap)

    tmp = tempfile.mkdtemp(prefix=".tmp-src-", dir=os.path.dirname(args.dst))
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):  # norms near 1, distinct per element
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                t = 0.02 * torch.randn(shape, generator=gen)
            tensors[name] = t.to(torch.bfloat16)
            weight_map[name] = fname
            total += tensors[name].numel() * 2
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(tmp)
    os.replace(tmp, args.dst)
    n_params = sum(_numel(s) for _, s in specs)
    return {"params": n_params, "bytes": total, "shards": len(shards)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shard_files(hf_dir: str) -> list:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def _baseline(args, fsync: bool) -> dict:
    import torch  # noqa: F401  (imported before the clock starts, as the converter's children do)
    from safetensors.torch import load_file, save_file

    floor = _own_kib("RssAnon") * 1024
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=".tmp-base-", dir=os.path.dirname(args.dst))
    for fname in _shard_files(args.src):
        tensors = load_file(os.path.join(args.src, fname))
        path = os.path.join(tmp, fname)
        save_file(tensors, path, metadata={"format": "pt"})
        del tensors
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    for name in os.listdir(args.src):
        if not name.endswith(".safetensors"):
            shutil.copy2(os.path.join(args.src, name), os.path.join(tmp, name))
    os.replace(tmp, args.dst)
    return {"seconds": time.perf_counter() - t0, "anon_floor": floor}


def phase_baseline(args) -> dict:
    """The plain load + save of the same bytes: load_file each shard, save_file it elsewhere."""
    return _baseline(args, fsync=False)


def phase_baseline_fsync(args) -> dict:
    """The same, each file fsync'ed (the torch_dist writer fsyncs its files; save_file does not)."""
    return _baseline(args, fsync=True)


def phase_to_megatron(args) -> dict:
    sys.path.insert(0, REPO)
    import megatron.core  # noqa: F401  (import cost outside the timed region)

    from megatron_klear.checkpoint.convert import hf_to_megatron

    floor = _own_kib("RssAnon") * 1024
    t0 = time.perf_counter()
    hf_to_megatron(args.src, args.dst, tp=1, pp=1, progress=False)
    return {"seconds": time.perf_counter() - t0, "anon_floor": floor}


def phase_to_hf(args) -> dict:
    sys.path.insert(0, REPO)
    import megatron.core  # noqa: F401

    from megatron_klear.checkpoint.convert import megatron_to_hf

    floor = _own_kib("RssAnon") * 1024
    t0 = time.perf_counter()
    megatron_to_hf(args.src, args.dst, max_shard_bytes=args.max_shard_bytes, progress=False)
    return {"seconds": time.perf_counter() - t0, "anon_floor": floor}


def phase_verify(args) -> dict:
    """Every tensor of the round trip (args.dst) equals the source (args.src) bit for bit."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    sys.path.insert(0, REPO)
    from megatron_klear.checkpoint.hf_io import HFReader

    shape = SHAPES[args.shape]
    model_type = "qwen3_moe" if shape.get("num_experts") else "qwen3"
    for d in (args.src, args.dst):
        c = AutoConfig.from_pretrained(d)
        got = {k: getattr(c, k) for k in shape}
        if c.model_type != model_type or got != shape:
            raise SystemExit(f"{d}/config.json: transformers reads {c.model_type} {got}")
    out = HFReader(args.dst)
    seen, mismatches, compared = set(), [], 0
    for fname in _shard_files(args.src):
        with safe_open(os.path.join(args.src, fname), framework="pt") as f:
            for key in f.keys():
                a = f.get_tensor(key)
                if key not in out.keys():
                    mismatches.append(f"{key}: missing from the round trip")
                    continue
                b = out.get(key)
                seen.add(key)
                compared += a.numel() * a.element_size()
                if a.dtype != b.dtype or a.shape != b.shape:
                    mismatches.append(f"{key}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}")
                elif not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    mismatches.append(f"{key}: values differ")
    extra = sorted(out.keys() - seen)
    mismatches += [f"{k}: not in the source" for k in extra]
    return {
        "bit_exact": not mismatches,
        "mismatches": mismatches[:10],
        "bytes_compared": compared,
        "tensors": len(seen),
    }


PHASES = {
    "make": phase_make,
    "baseline": phase_baseline,
    "baseline_fsync": phase_baseline_fsync,
    "to_megatron": phase_to_megatron,
    "to_hf": phase_to_hf,
    "verify": phase_verify,
}


# ------------------------------------------------------------------------------------------------
# Parent: runs each phase in a child, polls its memory, prints the table
# ------------------------------------------------------------------------------------------------


def _smaps_kib(pid: int) -> dict:
    """Pss and Pss_Anon of one process (shared pages divided among the processes mapping them)."""
    out = {"Pss": 0, "Pss_Anon": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _descendants(pid: int) -> list:
    """pid and all its descendants, from /proc/<pid>/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return out


def _own_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _io(pid: int) -> dict:
    """/proc/<pid>/io: write_bytes (sent to the storage layer, counted when pages are dirtied),
    wchar (bytes handed to write calls)."""
    out = {}
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError), open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def run_phase(
    phase: str, src: str | None, dst: str, max_shard_bytes: int, shape: str = "0.6B", interval: float = 0.01
) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        phase,
        "--dst",
        dst,
        "--max-shard-bytes",
        str(max_shard_bytes),
        "--shape",
        shape,
    ]
    if src:
        cmd += ["--src", src]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = {"anon": 0, "pss": 0, "procs": 1}
    io = {}  # pid -> its last /proc/<pid>/io (the child's own comes back in its RESULT)
    done = threading.Event()

    def poll():
        while not done.is_set():
            anon = pss = 0
            pids = _descendants(proc.pid)
            for p in pids:
                s = _smaps_kib(p)
                anon += s["Pss_Anon"]
                pss += s["Pss"]
            peak["anon"] = max(peak["anon"], anon * 1024)
            peak["pss"] = max(peak["pss"], pss * 1024)
            peak["procs"] = max(peak["procs"], len(pids))
            for p in pids[1:]:
                io[p] = _io(p) or io.get(p, {})
            time.sleep(interval)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed with exit code {proc.returncode}")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"phase {phase} printed no RESULT line; output:\n{stdout[-2000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    own = result.pop("io", {})
    result["write_bytes"] = own.get("write_bytes", 0) + sum(v.get("write_bytes", 0) for v in io.values())
    result.update(
        wall=wall, peak_rss=usage.ru_maxrss * 1024, peak_anon=peak["anon"], peak_pss=peak["pss"], procs=peak["procs"]
    )
    return result


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


def warm(path: str) -> None:
    """Read every file under path once, so the next phase starts with it in the page cache."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(64 * MiB):
                    pass


def run_round_trip(d: dict, cap: int, shape: str, made_line, row_line, clear_base: bool = False) -> tuple:
    """make, the plain copy (with and without fsync), both directions and verify, into the
    directories ``d`` (src, base, mg, back); ``made_line(made)`` and ``row_line(phase, row)`` are
    the lines printed as they finish. Returns (made, rows, verify)."""
    made = run_phase("make", None, d["src"], cap, shape)
    print(made_line(made), flush=True)
    rows = {}
    for phase, src, dst in (
        ("baseline", d["src"], d["base"]),
        ("baseline_fsync", d["src"], d["base"]),
        ("to_megatron", d["src"], d["mg"]),
        ("to_hf", d["mg"], d["back"]),
    ):
        shutil.rmtree(dst, ignore_errors=True)
        warm(src)
        rows[phase] = r = run_phase(phase, src, dst, cap, shape)
        r["output_bytes"] = dir_bytes(dst)
        print(row_line(phase, r), flush=True)
        if clear_base and phase == "baseline_fsync":
            shutil.rmtree(d["base"], ignore_errors=True)  # (room for the next outputs)
    return made, rows, run_phase("verify", d["src"], d["back"], cap, shape)


def bench_layout(work: str, shard_mb: int, keep: bool) -> dict:
    cap = shard_mb * MiB if shard_mb else UNLIMITED_SHARD
    label = f"{shard_mb} MiB shards" if shard_mb else "single file"
    d = {k: os.path.join(work, f"{k}-{shard_mb}") for k in ("src", "base", "mg", "back")}
    try:
        made, rows, check = run_round_trip(
            d,
            cap,
            "0.6B",
            lambda made: (
                f"[{label}] checkpoint: {made['params'] / 1e6:.1f} M params, {made['bytes'] / GiB:.3f} GiB, "
                f"{made['shards']} shard(s) (written in {made['wall']:.1f} s)"
            ),
            lambda phase, r: (
                f"[{label}] {phase:14s} {r['seconds']:7.2f} s (process {r['wall']:6.2f} s)  "
                f"peak RSS {r['peak_rss'] / GiB:6.3f} GiB  anon {r['peak_anon'] / GiB:6.3f} GiB "
                f"(floor {r['anon_floor'] / GiB:.3f})  PSS {r['peak_pss'] / GiB:6.3f} GiB  "
                f"processes {r['procs']}"
            ),
        )
        print(
            f"[{label}] round trip bit-exact: {check['bit_exact']} ({check['tensors']} tensors, "
            f"{check['bytes_compared'] / GiB:.3f} GiB compared)"
            + ("" if check["bit_exact"] else f"; first mismatches: {check['mismatches']}"),
            flush=True,
        )
        sizes = {k: dir_bytes(d[k]) for k in ("src", "mg", "back")}
        return {"label": label, "made": made, "rows": rows, "verify": check, "sizes": sizes}
    finally:
        if not keep:
            for v in d.values():
                shutil.rmtree(v, ignore_errors=True)


def report(results: list) -> None:
    print()
    for res in results:
        rows = res["rows"]
        base = rows["baseline"]
        print(
            f"### {res['label']}: {res['made']['params'] / 1e6:.1f} M params; HF checkpoint "
            f"{res['sizes']['src'] / GiB:.3f} GiB in {res['made']['shards']} file(s); torch_dist "
            f"{res['sizes']['mg'] / GiB:.3f} GiB; round trip {res['sizes']['back'] / GiB:.3f} GiB; "
            f"bit-exact: {res['verify']['bit_exact']}"
        )
        print(
            "| phase | call s | process s | peak RSS GiB | peak anon GiB | anon above floor GiB | peak PSS GiB "
            "| call / base | process / base | RSS / base | anon / base |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for phase, r in rows.items():
            print(
                f"| {phase} | {r['seconds']:.2f} | {r['wall']:.2f} | {r['peak_rss'] / GiB:.3f} | "
                f"{r['peak_anon'] / GiB:.3f} | {(r['peak_anon'] - r['anon_floor']) / GiB:.3f} | "
                f"{r['peak_pss'] / GiB:.3f} | {r['seconds'] / base['seconds']:.2f} | "
                f"{r['wall'] / base['wall']:.2f} | {r['peak_rss'] / base['peak_rss']:.2f} | "
                f"{r['peak_anon'] / base['peak_anon']:.2f} |"
            )
        h2m, m2h = rows["to_megatron"], rows["to_hf"]
        call, wall = h2m["seconds"] + m2h["seconds"], h2m["wall"] + m2h["wall"]
        print(
            f"HF -> Megatron -> HF: {call:.2f} s in the calls = {call / base['seconds']:.1f} x baseline "
            f"({call / rows['baseline_fsync']['seconds']:.1f} x the fsync'ed baseline); {wall:.2f} s of "
            f"process wall = {wall / base['wall']:.1f} x; peak RSS "
            f"{max(h2m['peak_rss'], m2h['peak_rss']) / base['peak_rss']:.2f} x baseline; peak anon "
            f"{max(h2m['peak_anon'], m2h['peak_anon']) / base['peak_anon']:.2f} x baseline"
        )
        print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--max-shard-bytes", type=int, default=UNLIMITED_SHARD, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="0.6B", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument(
        "--scaling",
        nargs="*",
        metavar="SHAPE",
        help=f"the scaling run: each of these shapes (default {' '.join(SCALING)}), each direction: "
        "peak anonymous memory, bytes written, time against the plain copy; then the extrapolation",
    )
    ap.add_argument(
        "--shard-mb",
        type=int,
        nargs="+",
        default=[0, 256],
        help="source shard caps in MiB to benchmark (0: one model.safetensors); default 0 256",
    )
    ap.add_argument("--scaling-report", metavar="JSON", help="print a saved scaling run's tables again")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temporary checkpoints go")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (under --workdir)")
    ap.add_argument("--json", help="also write the raw figures to this file")
    args = ap.parse_args()

    if args.phase:
        result = PHASES[args.phase](args)
        result["io"] = _io(os.getpid())
        print("RESULT " + json.dumps(result), flush=True)
        return

    if args.scaling_report:
        with open(args.scaling_report) as f:
            scaling_report(json.load(f))
        return
    if args.scaling is not None:
        scaling(args, [s for s in (args.scaling or SCALING)])
        return
    free = shutil.disk_usage(args.workdir).free
    need = 7 * GiB  # source, baseline copy, torch_dist + its staging files, round trip: ~1.1 GiB each
    if free < need:
        raise SystemExit(f"--workdir {args.workdir}: {free / GiB:.1f} GiB free, need ~{need / GiB:.0f} GiB")
    work = tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir)
    print(f"working in {work} ({free / GiB:.1f} GiB free)", flush=True)
    try:
        results = [bench_layout(work, mb, args.keep) for mb in args.shard_mb]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if not all(r["verify"]["bit_exact"] for r in results):
        raise SystemExit("round trip is NOT bit-exact")


def model_bytes(shape: dict) -> int:
    return 2 * sum(_numel(s) for _, s in _tensor_specs(shape))


def bench_shape(work: str, name: str) -> dict:
    """One shape of the scaling run; every directory removed before the next shape."""
    d = {k: os.path.join(work, f"{k}-{name}") for k in ("src", "base", "mg", "back")}
    try:
        made, rows, check = run_round_trip(
            d,
            HUB_SHARD,
            name,
            lambda made: (
                f"[{name}] {made['params'] / 1e9:.2f} B params, {made['bytes'] / 1e9:.2f} GB in "
                f"{made['shards']} shard(s), made in {made['wall']:.0f} s"
            ),
            lambda phase, r: (
                f"[{name}] {phase:14s} {r['seconds']:7.1f} s  anon {r['peak_anon'] / GiB:6.3f} GiB "
                f"(floor {r['anon_floor'] / GiB:.3f})  written {r['write_bytes'] / 1e9:7.2f} GB for "
                f"{r['output_bytes'] / 1e9:7.2f} GB of output"
            ),
            clear_base=True,
        )
        print(
            f"[{name}] round trip bit-exact: {check['bit_exact']}"
            + ("" if check["bit_exact"] else f" {check['mismatches']}"),
            flush=True,
        )
        return {"shape": name, "made": made, "rows": rows, "verify": check}
    finally:
        for v in d.values():
            shutil.rmtree(v, ignore_errors=True)


def _fit(xs: list, ys: list) -> tuple:
    """Least-squares line y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def scaling(args, names: list) -> None:
    biggest = max(model_bytes(SHAPES[n]) for n in names)
    free = shutil.disk_usage(args.workdir).free
    if free < 3.2 * biggest:
        raise SystemExit(
            f"--workdir {args.workdir}: {free / 1e9:.0f} GB free, the scaling run needs "
            f"~{3.2 * biggest / 1e9:.0f} GB (source, torch_dist, round trip of the largest shape)"
        )
    work = tempfile.mkdtemp(prefix="bench-convert-scaling-", dir=args.workdir)
    try:
        results = [bench_shape(work, n) for n in names]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    scaling_report(results)
    if not all(r["verify"]["bit_exact"] for r in results):
        raise SystemExit("round trip is NOT bit-exact")


def scaling_report(results: list) -> None:
    """The scaling run's tables (also from a saved ``--json``: ``--scaling-report FILE``)."""
    print()
    print(
        "| shape | GB | direction | s | plain copy s (fsync'ed) | ratio | peak anon GiB | anon above floor GiB "
        "| written GB | output GB | written / output |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        rows, gb = res["rows"], res["made"]["bytes"] / 1e9
        base, basef = rows["baseline"]["seconds"], rows["baseline_fsync"]["seconds"]
        for phase in ("to_megatron", "to_hf"):
            r = rows[phase]
            print(
                f"| {res['shape']} | {gb:.2f} | {phase} | {r['seconds']:.1f} | {base:.1f} ({basef:.1f}) | "
                f"{r['seconds'] / base:.2f} | {r['peak_anon'] / GiB:.3f} | "
                f"{(r['peak_anon'] - r['anon_floor']) / GiB:.3f} | {r['write_bytes'] / 1e9:.2f} | "
                f"{r['output_bytes'] / 1e9:.2f} | {r['write_bytes'] / max(1, r['output_bytes']):.3f} |"
            )
        trip = rows["to_megatron"]["seconds"] + rows["to_hf"]["seconds"]
        res["round_trip_ratio"] = trip / base
        res["round_trip_ratio_fsync"] = trip / basef
        print(
            f"| {res['shape']} | {gb:.2f} | round trip | {trip:.1f} | {base:.1f} ({basef:.1f}) | "
            f"{trip / base:.2f} ({trip / basef:.2f} fsync'ed) | | | | | |"
        )
    by = {r["shape"]: r for r in results}
    print()
    if "0.6B" in by and "8B" in by:
        for phase in ("to_megatron", "to_hf"):
            ratio = by["8B"]["rows"][phase]["peak_anon"] / by["0.6B"]["rows"][phase]["peak_anon"]
            print(f"target: peak anon 8B / 0.6B, {phase}: {ratio:.2f} (<= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})")
    worst = max(
        r["rows"][p]["write_bytes"] / max(1, r["rows"][p]["output_bytes"])
        for r in results
        for p in ("to_megatron", "to_hf")
    )
    print(f"target: bytes written / output, worst: {worst:.3f} (<= 1.05: {'met' if worst <= 1.05 else 'NOT met'})")
    for n in ("4B", "8B"):
        if n in by:
            r = by[n]["round_trip_ratio"]
            print(
                f"target: round trip / plain copy at {n}: {r:.2f} (<= 2: {'met' if r <= 2 else 'NOT met'}; "
                f"{by[n]['round_trip_ratio_fsync']:.2f} against the fsync'ed copy)"
            )
    dense = [r for r in results if r["shape"] != "moe"]
    moe = by.get("moe")
    if len(dense) >= 2:
        print()
        print(
            "extrapolation: dense models from a line through the dense sizes; MoE models from the MoE "
            "shape's seconds per GB and its peak (the bound does not depend on the number of experts)"
        )
        print("| model | GB of bf16 | direction | peak anon GiB | disk GB (output + source) | s |")
        print("|---|---|---|---|---|---|")
        xs = [r["made"]["bytes"] for r in dense]
        for phase in ("to_megatron", "to_hf"):
            anon = _fit(xs, [r["rows"][phase]["peak_anon"] for r in dense])
            secs = _fit(xs, [r["rows"][phase]["seconds"] for r in dense])
            wr = max(r["rows"][phase]["write_bytes"] / max(1, r["rows"][phase]["output_bytes"]) for r in results)
            for name, shape in EXTRAPOLATE.items():
                x = model_bytes(shape)
                if shape.get("num_experts") and moe:
                    peak = moe["rows"][phase]["peak_anon"]
                    t = moe["rows"][phase]["seconds"] * x / moe["made"]["bytes"]
                else:
                    peak, t = anon[0] + anon[1] * x, secs[0] + secs[1] * x
                print(f"| {name} | {x / 1e9:.0f} | {phase} | {peak / GiB:.2f} | {x * (1 + wr) / 1e9:.0f} | {t:.0f} |")


if __name__ == "__main__":
    main()
