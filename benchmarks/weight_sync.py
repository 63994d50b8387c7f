"""Weights to two rollout servers: disk (sequential and parallel reload) vs SGLang's distributed
protocol over gloo vs the raw gloo broadcast of the same bytes, all in one run.

    python benchmarks/weight_sync.py                       # 8 layers of Qwen3-0.6B's shape (~0.56 GB)
    python benchmarks/weight_sync.py --layers 28 --json out.json
    python benchmarks/weight_sync.py --quick               # a small model, seconds (the test runs it)
    python benchmarks/weight_sync.py --engine vllm         # the same against two vLLM CPU servers
    python benchmarks/weight_sync.py --engine vllm --variants raw_broadcast --delta-lrs 1e-6,1e-5,1e-4

Setup: a random bf16 checkpoint with Qwen3-0.6B's shapes (hidden 1024, intermediate 3072, 16 query /
8 KV heads of 128, vocabulary 151,936, tied embeddings; ``--layers`` of its 28 layers: the embedding
is 311 MB, each layer 31.5 MB), written by ``benchmarks/convert.py``'s writer; two embedded servers
(``python -m megatron_klear.rollout.embedded --dtype bfloat16``, subprocesses); the trainer at TP=2
(two processes, gloo; the model only, bf16: no optimizer, which a sync does not touch); two extra
receiver processes for the raw broadcast. Every variant moves the whole model to both servers:

- ``disk_sequential``: rank 0 writes the HF checkpoint (``export_hf_for_engine``, the TP shards
  gathered), then each server loads it with ``/update_weights_from_disk``, one after the other (how
  servers were updated before the parallel reload);
- ``disk_parallel``: the same, both servers loading at once (``SGLangEngine.load_from_disk``, the
  ``rollout.weight_sync=disk`` fallback);
- ``disk_flushed``: ``disk_parallel`` with the files written to the disk and dropped from the page
  cache before the servers read them (fsync + ``POSIX_FADV_DONTNEED``), as servers on other nodes
  read what the trainer wrote to a shared filesystem: the bytes leave the writer's memory and come
  back from storage (``--sync-dir`` chooses the disk);
- ``distributed``: ``DistributedWeightSync.sync`` (pause, begin, the buckets of ``--bucket-mb`` with
  the TP gathers overlapping the broadcasts, end, version, continue, version check), the group
  already created (its creation is reported apart), in the steady state of a run: an untimed
  distributed sync just before each timed one, so the layout is recorded (the streamed schedule)
  and the servers receive into the storages the previous update replaced, as in a run where every
  step syncs this way;
- ``raw_broadcast``: the same bucket sizes broadcast from trainer rank 0 to two receivers that do
  nothing else (no HTTP, no gathering, no packing, no staging): the collective's floor;
- ``in_memory``: ``rollout.weight_sync=memory``'s push (``InMemoryPush``: the TP shards gathered
  bucket by bucket, each bucket shared in memory and loaded by both servers: SGLang's
  ``/update_weights_from_tensor``, vLLM's ``/update_weights`` through the project's transfer
  engine), what colocated servers get instead of ``disk_parallel``;
- ``in_memory_relay`` (not in the default set; SGLang stand-in): the same push as a two-node
  colocated job makes it: trainer rank 1 stands for a second machine (its addresses are those of
  127.0.0.2, where the second server listens), so rank 0 relays every bucket to it over gloo and
  the second server maps rank 1's copy (``rollout/weight_sync/relay.py``); its ratio to
  ``in_memory`` is the relay's cost (``relay_cost_vs_in_memory``).

Each variant runs ``--repeats`` times, interleaved (median reported, and the fastest under ``best``:
on a shared machine other jobs only ever add time); ``--variants`` runs a subset. Every timed push
is checked where it lands, outside its time: the trainer negates its weights before each push (so
it carries bytes no server holds), and after it both servers' weight version, and with the SGLang
stand-ins every weight's ``/weights_checker`` checksum, must be the trainer's (vLLM has no checksum
route: its version only); a push that did not land ends the benchmark (JSON ``landed``). JSON keys:
``disk_s`` (= ``disk_parallel_s``, the fallback, page cache), ``disk_sequential_s``,
``disk_flushed_s``, ``distributed_s``, ``raw_broadcast_s``, ``speedup_vs_disk`` (disk_s /
distributed_s), ``speedup_vs_disk_flushed``, ``speedup_vs_disk_sequential``, ``efficiency_vs_raw``
(raw_broadcast_s / distributed_s: the protocol's throughput as a fraction of the bare
collective's), ``distributed_stats`` (bytes, buckets, streamed stages, seconds of each timed sync),
plus sizes and the machine.

``--delta-lrs`` (either engine: the stand-in servers start with the SGLang delta loader) then measures delta syncs
(``rollout.sync_delta``) after the variants: per learning rate, a full sync, then ``--repeats``
steps, each an update of every weight followed by a timed delta sync. The update is Adam-shaped
without an optimizer: fp32 master weights move by ``lr`` x a unit-scale random direction per
element (what Adam's normalised step does early in training) and the bf16 model weights are their
rounding, as Megatron's mixed-precision optimizer writes them. JSON ``delta``: per learning rate the
fraction of elements changed, the delta's bytes against the full sync's, and the delta sync's time
against the full sync's and the raw broadcast's of the whole model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


# --quick: a small model of the same structure (seconds; what the test runs)
QUICK = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    bos_token_id=1,
    eos_token_id=2,
)


def make_checkpoint(path: str, layers: int, quick: bool = False) -> dict:
    import convert  # benchmarks/convert.py: the Qwen3-0.6B-shaped random checkpoint writer

    convert.SHAPES["weight_sync"] = {**convert.QWEN3_0_6B, "num_hidden_layers": layers, **(QUICK if quick else {})}
    return convert.phase_make(
        argparse.Namespace(dst=path, max_shard_bytes=convert.UNLIMITED_SHARD, shape="weight_sync")
    )


VARIANTS = ("disk_sequential", "disk_parallel", "disk_flushed", "distributed", "raw_broadcast", "in_memory")
RELAY = "in_memory_relay"  # asked for by name (--variants)
SECOND_SERVER_HOST = "127.0.0.2"  # the second stand-in server's address (loopback, this machine)


def flush_to_disk(path: str) -> None:
    """Write the checkpoint's bytes to the disk and drop them from the page cache (fsync, then
    ``POSIX_FADV_DONTNEED``): the servers then read them from the disk, as servers on other nodes
    read what the trainer wrote to a shared filesystem (the bytes leave the writer's memory and come
    back from storage)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ------------------------------------------------------------------------------------------------
# raw receivers
# ------------------------------------------------------------------------------------------------
def raw_receiver(rank: int, port: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    from megatron_klear.rollout.servers.update_group import join_update_group

    torch.set_num_threads(1)
    pg = join_update_group(
        backend="gloo",
        master_address="127.0.0.1",
        master_port=port,
        rank=rank,
        world_size=world,
        group_name="raw_bench",
        timeout=600,
    )
    buf = None
    while True:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=pg)
        if int(n) < 0:
            return
        sizes = torch.zeros(int(n), dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=pg)
        top = int(sizes.max())
        if buf is None or buf.numel() < top:
            buf = torch.empty(top, dtype=torch.uint8)
        for size in sizes.tolist():
            dist.broadcast(buf[:size], src=0, group=pg)


# ------------------------------------------------------------------------------------------------
# the trainer (TP=2)
# ------------------------------------------------------------------------------------------------
def trainer(rank: int, world: int, port: int, ckpt: str, urls: list, args, raw_port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", _trainer(rank, ckpt, urls, args, raw_port)))
    except BaseException as e:  # noqa: BLE001 -- reported by the parent
        import traceback

        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _trainer(rank, ckpt, urls, args, raw_port):
    import torch
    import torch.distributed as dist

    from megatron_klear.config import load_config
    from megatron_klear.models.builder import build_model_chunks
    from megatron_klear.platform import init_parallel
    from megatron_klear.rollout.servers.update_group import join_update_group, open_master_store
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.vllm import VLLMEngine
    from megatron_klear.rollout.weight_sync import export_hf_for_engine, iter_buckets
    from megatron_klear.training.setup import load_initial_weights, model_arch

    cfg = load_config(None, [f"model.path={ckpt}", "parallel.tp=2", "model.dtype=bf16"])
    init_parallel(cfg.parallel)
    chunks = build_model_chunks(model_arch(ckpt), cfg.model, cfg.parallel)
    load_initial_weights(chunks, ckpt)
    from megatron_klear.platform import control_group

    def barrier():
        dist.barrier(group=control_group())

    engine_cls = VLLMEngine if args.engine == "vllm" else SGLangEngine
    engine = engine_cls.at(urls, control_timeout_s=120, weight_update_timeout_s=1800) if rank == 0 else None
    sync = _make_sync(chunks, engine, args)
    if args.timeline:
        _record_timeline(sync, engine, os.path.join(args.timeline, f"trainer-{rank}.jsonl"))
    tp_group = __import__("megatron.core.parallel_state", fromlist=["x"]).get_tensor_model_parallel_group()
    from megatron_klear.checkpoint.model_weights import iter_hf_tensors

    # the bucket sizes of this model (what the distributed sync sends): the raw broadcast repeats them
    sizes = [
        sum(t.numel() * t.element_size() for _, t in b)
        for b in iter_buckets(iter_hf_tensors(chunks, tp_group=tp_group), sync.bucket_bytes)
    ]
    raw_pg = None
    if rank == 0:
        store = open_master_store("127.0.0.1", raw_port, 3, 600)
        raw_pg = join_update_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=raw_port,
            rank=0,
            world_size=3,
            group_name="raw_bench",
            timeout=600,
            store=store,
        )
    from types import SimpleNamespace

    from megatron_klear.rl.rollout.placement import Dedicated
    from megatron_klear.rollout.weight_sync import in_memory as in_memory_module
    from megatron_klear.rollout.weight_sync.in_memory import InMemoryPush

    # which machine each rank reports (read once, at each push object's first push): one machine
    # with both servers, or (the relay variant) rank 1 on a second one with the second server
    two_machines = [False]
    in_memory_module.machine_addresses = lambda: (
        {f"127.0.0.{rank + 1}"} if two_machines[0] else {"127.0.0.1", SECOND_SERVER_HOST}
    )
    in_memory = InMemoryPush(SimpleNamespace(model=chunks), engine, Dedicated(), args.bucket_mb, fallback=None)
    relayed = InMemoryPush(SimpleNamespace(model=chunks), engine, Dedicated(), args.bucket_mb, fallback=None)
    barrier()
    times = {v: [] for v in (*VARIANTS, RELAY)}
    landed = {v: [] for v in (*VARIANTS, RELAY)}  # how each timed push was seen on the servers
    stats = []
    t0 = time.perf_counter()
    sync.sync(version="warmup")  # creates the groups
    first = time.perf_counter() - t0
    version, served = 0, "warmup"  # (the servers hold the warm-up sync until a variant updates them)
    workdir = tempfile.mkdtemp(prefix="klear-wsync-", dir=args.sync_dir or None) if rank == 0 else None
    workdir = [workdir]
    dist.broadcast_object_list(workdir, src=0, group=control_group())
    workdir = workdir[0]
    for _ in range(args.repeats):
        for variant in args.variants:
            version += 1
            if variant == "distributed":
                # steady state: in a run every update takes this path, so the servers receive into
                # the storages the previous one replaced (after a disk reload they allocate afresh)
                sync.sync(version=f"{version}-prep")
            if variant != "raw_broadcast":  # new bytes for this push: the check after it sees whether they landed
                _flip_signs(chunks)
            barrier()
            t0 = time.perf_counter()
            if variant.startswith("disk"):
                out = os.path.join(workdir, f"step_{version:07d}")
                path = export_hf_for_engine(chunks, model_arch(ckpt), out)
                if rank == 0:
                    if variant == "disk_flushed":
                        flush_to_disk(path)
                    if variant == "disk_sequential":
                        for u in urls:
                            engine_cls.at([u], control_timeout_s=120, weight_update_timeout_s=1800).load_from_disk(
                                path, version=version
                            )
                    else:
                        engine.load_from_disk(path, version=version)
            elif variant == "distributed":
                sync.sync(version=version)
                stats.append(dict(sync.stats))
            elif variant == "in_memory":
                in_memory.push(version)
            elif variant == RELAY:
                two_machines[0] = True
                relayed.push(version)
                two_machines[0] = False
            elif rank == 0:
                buf = torch.empty(max(sizes), dtype=torch.uint8)
                dist.broadcast(torch.tensor([len(sizes)], dtype=torch.int64), src=0, group=raw_pg)
                dist.broadcast(torch.tensor(sizes, dtype=torch.int64), src=0, group=raw_pg)
                for size in sizes:
                    dist.broadcast(buf[:size], src=0, group=raw_pg)
            barrier()
            times[variant].append(time.perf_counter() - t0)
            if variant != "raw_broadcast":
                served = version
                landed[variant].append(_check_landed(chunks, engine, urls, args, version, tp_group))
            if rank == 0 and variant.startswith("disk"):
                shutil.rmtree(os.path.join(workdir, f"step_{version:07d}"), ignore_errors=True)
    if rank == 0:
        dist.broadcast(torch.tensor([-1], dtype=torch.int64), src=0, group=raw_pg)
        shutil.rmtree(workdir, ignore_errors=True)
        engine.members.check_weight_versions(served)  # the last update reached both servers
    sync.close()
    delta = _delta_phase(chunks, engine, args, barrier, version) if args.delta_lrs else {}
    return {
        "times": times,
        "landed": landed,
        "first_distributed_s": first,
        "sizes": sizes,
        "stats": stats,
        "delta": delta,
    }


def _flip_signs(chunks) -> None:
    """Every weight of the trainer negated (exact in any dtype): the next push carries bytes no
    server holds, so a push that did not land fails :func:`_check_landed`."""
    import torch

    from megatron_klear.checkpoint.model_weights import unwrap

    with torch.no_grad():
        for chunk in chunks:
            for p in unwrap(chunk).parameters():
                p.neg_()


def _check_landed(chunks, engine, urls, args, version, tp_group) -> str:
    """Collective, after a timed push (outside its time): every server holds the trainer's weights.
    SGLang stand-ins: each parameter's checksum (``/weights_checker``) equals the trainer's, and the
    version; vLLM (no checksum route): the version. Raises naming the server and the first weight
    that differs; returns how it was checked."""
    import httpx

    from megatron_klear.checkpoint.model_weights import iter_hf_tensors
    from megatron_klear.rollout.embedded.weights import tensor_checksum

    want = {name: tensor_checksum(t) for name, t in iter_hf_tensors(chunks, tp_group=tp_group)}
    if engine is None:  # (rank 1: its part of the gather is done)
        return ""
    engine.members.check_weight_versions(version)
    if args.engine == "vllm":
        return "version"
    for url in urls:
        got = httpx.get(url + "/weights_checker", timeout=120).json()["ranks"][0]["checksums"]
        compared = [name for name in want if name in got]
        differs = [name for name in compared if got[name] != want[name]]
        if differs or len(compared) < len(want) - 1:  # (a tied lm_head is not a parameter of its own)
            raise RuntimeError(
                f"weight_sync benchmark: the push of version {version} did not land on {url}: "
                f"{len(differs)} of {len(compared)} weights differ (first: {differs[:1]})"
            )
    return "checksums"


def _make_sync(chunks, engine, args, **keys):
    """The distributed sync the variants time (``keys``: the delta settings)."""
    from megatron_klear.rollout.weight_sync import DistributedWeightSync

    return DistributedWeightSync(
        chunks,
        engine,
        bucket_mb=args.bucket_mb,
        group_timeout=600,
        bucket_timeout=600,
        control_timeout=120,
        load_format=None if args.load_format == "auto" else args.load_format,
        **keys,
    )


def _wrap_timed(obj, name: str, record) -> None:
    """Replace ``obj.name`` by a wrapper that calls ``record(start, end)`` (wall-clock seconds) after
    each call, whatever it raised."""
    inner = getattr(obj, name)

    def wrapper(*a, **k):
        start = time.time()
        try:
            return inner(*a, **k)
        finally:
            record(start, time.time())

    setattr(obj, name, wrapper)


def _record_timeline(sync, engine, path: str) -> None:
    """Append each sync's phases to ``path`` (JSON lines: phase, wall-clock start and end): the whole
    sync, each bucket from its launch to its end (gathered, posted, broadcast, answered), and on rank
    0 the servers' calls around it."""
    import json

    def line(phase):
        def record(start, end):
            with open(path, "a") as f:
                f.write(json.dumps({"phase": phase, "start": start, "end": end}) + "\n")

        return record

    _wrap_timed(sync, "sync", line("sync"))
    _wrap_timed(sync.buckets, "_launch_bucket", line("launch_bucket"))
    _wrap_timed(sync.buckets, "_finish_bucket", line("finish_bucket"))
    if engine is not None:
        for name in ("start_update", "pause", "flush_caches", "begin", "finish_update"):
            _wrap_timed(engine.wire, name, line(name))


def _fmt(phases: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items()))


def _time_phases(sync, engine) -> dict:
    """{phase: seconds} of the sync under way, filled by timers around its parts: ``encode`` (the
    leader's comparison with its images), and on rank 0 the servers' calls: ``start`` (pause, flush,
    begin: overlapped with the first bucket's gathering), ``end`` (the session's end: vLLM finalises
    its layerwise reload there), ``finish`` (end, version, resume, checks)."""
    phases = {}

    def add(key):
        def record(start, end):
            phases[key] = phases.get(key, 0.0) + end - start

        return record

    _wrap_timed(sync.delta, "encode", add("encode"))
    if engine is not None:
        for name in ("start_update", "end", "finish_update"):
            _wrap_timed(engine.wire, name, add({"start_update": "start", "finish_update": "finish"}.get(name, name)))
    return phases


def _delta_phase(chunks, engine, args, barrier, version) -> dict:
    """Per learning rate: a full sync, then ``repeats`` x (an Adam-shaped update of every weight, a
    timed delta sync). {lr: {full_s, delta_s: [...], changed_frac: [...], bytes_frac: [...]}}."""
    import torch

    sync = _make_sync(chunks, engine, args, delta=True, full_every=10**9)
    phases = _time_phases(sync, engine)
    params = [p for c in chunks for p in c.parameters()]
    masters = [p.detach().float().clone() for p in params]
    g = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    out = {}

    def timed_sync() -> tuple:
        """(seconds, its phases) of one sync, every rank at the start line."""
        nonlocal version
        version += 1
        phases.clear()
        barrier()
        t0 = time.perf_counter()
        sync.sync(version=version)
        barrier()
        return time.perf_counter() - t0, dict(phases)

    for lr in [float(x) for x in args.delta_lrs.split(",") if x]:
        sync.delta.discard()  # the next sync sends everything whole
        full_s, full_phases = timed_sync()
        full_bytes = sync.stats["bytes"]
        rec = {"full_s": full_s, "full_bytes": full_bytes, "delta_s": [], "changed_frac": [], "bytes_frac": []}
        rec["full_phases"], rec["phases"] = full_phases, []
        for _ in range(args.repeats):
            with torch.no_grad():
                for p, m in zip(params, masters):
                    m.add_(torch.randn(m.shape, generator=g), alpha=lr)
                    p.copy_(m.to(p.dtype))
            seconds, delta_phases = timed_sync()
            rec["delta_s"].append(seconds)
            rec["phases"].append(delta_phases)
            if sync.stats.get("elements"):  # rank 0 (the stage's leader) has the totals
                rec["changed_frac"].append(sync.stats["changed"] / sync.stats["elements"])
                rec["bytes_frac"].append(sync.stats["bytes"] / full_bytes)
        out[lr] = rec
        if not rec["changed_frac"]:
            continue
        print(f"  phases (s): full {_fmt(rec['full_phases'])}; delta {_fmt(rec['phases'][-1])}", flush=True)
        print(
            f"lr {lr:g}: changed {statistics.median(rec['changed_frac']):.4%} of elements, "
            f"{statistics.median(rec['bytes_frac']):.4%} of the bytes; delta {statistics.median(rec['delta_s']):.3f} s "
            f"against full {full_s:.3f} s",
            flush=True,
        )
    sync.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--layers", type=int, default=8, help="layers of Qwen3-0.6B's 28 (default 8: a few minutes on 2 cores)"
    )
    ap.add_argument(
        "--bucket-mb", type=float, default=256.0, help="rollout.sync_bucket_mb (default 256: several buckets)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a small model (vocabulary 8192, hidden 256), 2 layers, 1 MB buckets, 1 repeat: seconds",
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of "
        + ", ".join((*VARIANTS, RELAY))
        + f" (a ratio needs both of its variants; {RELAY} only when named)",
    )
    ap.add_argument(
        "--engine",
        choices=("sglang", "vllm"),
        default="sglang",
        help="the servers: the SGLang stand-in (embedded engine) or vLLM's CPU build (.venv-vllm, make venv)",
    )
    ap.add_argument("--vllm-python", default=os.path.join(REPO, ".venv-vllm", "bin", "python"))
    ap.add_argument("--sync-dir", default="", help="where the disk variants write (default: the temporary directory)")
    ap.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "flattened_bucket"),
        help="the distributed sync's wire: one broadcast per tensor (auto) or per bucket",
    )
    ap.add_argument(
        "--timeline",
        default="",
        help="a directory: the trainer's ranks and the vLLM workers write each sync's phases there "
        "(trainer-<rank>.jsonl, worker-<pid>.jsonl: phase, wall-clock start and end)",
    )
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--workdir", default="")
    ap.add_argument(
        "--delta-lrs",
        default="",
        help="comma-separated learning rates: measure delta syncs after the variants",
    )
    args = ap.parse_args()
    if args.quick:
        args.layers, args.bucket_mb, args.repeats = 2, 1.0, 1
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - {*VARIANTS, RELAY}
    if unknown or not args.variants:
        ap.error(f"--variants: unknown {sorted(unknown)}" if unknown else "--variants: none given")
    if RELAY in args.variants and args.engine != "sglang":
        ap.error(f"--variants: {RELAY} runs with the SGLang stand-in only (--engine sglang)")

    import torch.multiprocessing as mp

    from megatron_klear.platform.process import free_port
    from megatron_klear.rollout.in_server.sglang_delta import LOADER
    from megatron_klear.rollout.servers.update_group import TIMELINE_ENV
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from megatron_klear.rollout.vllm.launcher import VLLMServer

    work = args.workdir or tempfile.mkdtemp(prefix="klear-bench-wsync-")
    os.makedirs(work, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    ckpt = os.path.join(work, "qwen3-0.6b-shape")
    if not os.path.isdir(ckpt):
        made = make_checkpoint(ckpt, args.layers, args.quick)
        print(
            f"checkpoint: {made['params'] / 1e6:.0f} M params, {made['bytes'] / 1e9:.3f} GB bf16, {args.layers} layers",
            flush=True,
        )
    servers = []
    procs = []
    try:
        # server k on GPU k of the node, where trainer rank k runs (in memory each server maps the copy
        # of the rank on its own GPU): SGLang's --base-gpu-id, vLLM's CUDA_VISIBLE_DEVICES
        for k, host in enumerate(("127.0.0.1", SECOND_SERVER_HOST)):
            if args.engine == "vllm":  # bf16, the plugin's transfer engine for the distributed variant
                servers.append(
                    VLLMServer.launch(
                        ckpt,
                        python=args.vllm_python,
                        dtype="bfloat16",
                        max_model_len=512,
                        extra_args=("--weight-transfer-config", '{"backend": "megatron_klear"}'),
                        env={
                            "CUDA_VISIBLE_DEVICES": str(k),
                            **({TIMELINE_ENV: args.timeline} if args.timeline else {}),
                        },
                    )
                )
                continue
            servers.append(  # with the delta loader SGLang servers need for --delta-lrs
                EmbeddedHTTPEngine.launch(
                    ckpt,
                    host=host,  # the second on another loopback address: another machine to in_memory_relay
                    dtype="bfloat16",
                    weight_sync_timeout=600,
                    startup_timeout=600,
                    timeout=120,
                    custom_weight_loader=[LOADER],
                    base_gpu_id=k,
                )
            )
        print("servers:", [s.url for s in servers], flush=True)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        raw_port, port = free_port(), free_port()
        procs = [ctx.Process(target=raw_receiver, args=(r, raw_port, 3)) for r in (1, 2)]
        procs += [
            ctx.Process(target=trainer, args=(r, 2, port, ckpt, [s.url for s in servers], args, raw_port, queue))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = {}
        while len(results) < 2:
            rank, status, payload = queue.get(timeout=3600)
            if status != "ok":
                raise SystemExit(f"trainer rank {rank} failed:\n{payload}")
            results[rank] = payload
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for s in servers:
            s.close()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    r = results[0]
    med = {k: statistics.median(v) for k, v in r["times"].items() if v}
    best = {k: min(v) for k, v in r["times"].items() if v}
    total = sum(r["sizes"])

    def ratios(t):  # None where a variant was not run
        def q(a, b):
            return t[a] / t[b] if a in t and b in t else None

        return {
            "speedup_vs_disk": q("disk_parallel", "distributed"),
            "speedup_vs_disk_sequential": q("disk_sequential", "distributed"),
            "speedup_vs_disk_flushed": q("disk_flushed", "distributed"),
            "in_memory_speedup_vs_disk": q("disk_parallel", "in_memory"),
            "in_memory_speedup_vs_disk_flushed": q("disk_flushed", "in_memory"),
            "relay_cost_vs_in_memory": q(RELAY, "in_memory"),
            "efficiency_vs_raw": q("raw_broadcast", "distributed"),
        }

    out = {
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "load_average_before": [round(x, 1) for x in load_before],
            "load_average_after": [round(x, 1) for x in os.getloadavg()],
        },
        "layers": args.layers,
        "model_bytes": total,
        "buckets": len(r["sizes"]),
        "bucket_mb": args.bucket_mb,
        "servers": 2,
        "engine": args.engine,
        "trainer_tp": 2,
        "repeats": args.repeats,
        **{f"{k}_s": v for k, v in med.items()},
        "disk_s": med.get("disk_parallel"),
        "first_distributed_s": r["first_distributed_s"],
        **ratios(med),
        "distributed_gb_per_s": total / med["distributed"] / 1e9 if "distributed" in med else None,
        "raw_gb_per_s": total / med["raw_broadcast"] / 1e9 if "raw_broadcast" in med else None,
        # the fastest of the repeats (a shared machine adds delays, never removes them)
        "best": {**{f"{k}_s": v for k, v in best.items()}, **ratios(best)},
        "all_times": r["times"],
        # how each timed push was seen to land on both servers (checksums: every weight's; version:
        # vLLM's label only, it has no checksum route)
        "landed": {k: v for k, v in r["landed"].items() if v},
        "distributed_stats": r["stats"],
        "delta": {
            str(lr): {
                "changed_frac": statistics.median(d["changed_frac"]),
                "bytes_frac": statistics.median(d["bytes_frac"]),
                "delta_s": statistics.median(d["delta_s"]),
                "full_s": d["full_s"],
                "delta_vs_full": statistics.median(d["delta_s"]) / d["full_s"],
                "delta_vs_raw": statistics.median(d["delta_s"]) / med["raw_broadcast"]
                if "raw_broadcast" in med
                else None,
                "all": d,
            }
            for lr, d in r["delta"].items()
        },
    }
    print(
        f"\n{total / 1e9:.3f} GB in {len(r['sizes'])} buckets of <= {args.bucket_mb:g} MB to 2 {args.engine} servers, "
        "trainer TP=2 "
        f"(median of {args.repeats})"
    )
    print(f"{'variant':<20}{'median s':>10}{'GB/s':>8}{'best s':>10}")
    for k in med:
        print(f"{k:<20}{med[k]:>10.3f}{total / med[k] / 1e9:>8.2f}{best[k]:>10.3f}")
    b = out["best"]
    for key, what in (
        ("speedup_vs_disk", "speedup vs disk (parallel, page cache)"),
        ("speedup_vs_disk_flushed", "speedup vs disk (parallel, flushed to the disk)"),
        ("speedup_vs_disk_sequential", "speedup vs disk (sequential, page cache)"),
        ("in_memory_speedup_vs_disk", "in memory (colocated) vs disk (parallel, page cache)"),
        ("in_memory_speedup_vs_disk_flushed", "in memory (colocated) vs disk (flushed to the disk)"),
        ("relay_cost_vs_in_memory", "in memory across two machines (relayed) / on one machine"),
        ("efficiency_vs_raw", "efficiency vs raw broadcast"),
    ):
        if out[key] is not None:
            print(f"{what}: {out[key]:.2f} (best {b[key]:.2f})")
    print(
        f"load average before / after: {out['machine']['load_average_before']} / {out['machine']['load_average_after']}"
    )
    print(f"first distributed sync (group creation included): {r['first_distributed_s']:.3f} s")
    for lr, d in out["delta"].items():
        raw = f", {d['delta_vs_raw']:.2f}x the raw broadcast of the whole model" if d["delta_vs_raw"] else ""
        print(
            f"delta at lr {lr}: {d['changed_frac']:.4%} of elements and {d['bytes_frac']:.4%} of the bytes changed; "
            f"{d['delta_s']:.3f} s = {d['delta_vs_full']:.2f}x the full sync ({d['full_s']:.3f} s){raw}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
