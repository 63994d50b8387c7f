"""The user's journey at Qwen3-0.6B's real shapes, end to end on the CPU, phase by phase.

    python benchmarks/journey.py            # the whole architecture (28 layers): ~17 minutes on 2 cores
    python benchmarks/journey.py --quick    # 2 layers of the same width: a few minutes (tests/test_journey_at_width.py)

A random-weight checkpoint of Qwen3-0.6B's architecture as published (vocabulary 151,936, hidden
1024, 28 layers, 16 query / 8 KV heads of 128, intermediate 3072, tied embeddings, RoPE theta 1e6),
with the project's tiny tokenizer (its few hundred tokens; the embedding rows past them are the
padded vocabulary, as Qwen3's own 151,936 rows pad its 151,669 tokens), goes through what users run:

1. ``make``: the HF checkpoint (sharded safetensors);
2. ``convert``: ``tools/convert_hf_to_megatron.py --tp 2``;
3. ``sft``: ``python -m megatron_klear sft`` with the shipped 8B config under torchrun (TP=2, two
   processes of one thread), 3 steps of packed rows of 4,096 tokens (``--quick``: 1 step of 64);
   in the config's bf16, ``--quick`` in fp32 (``--dtype``: on a CPU without AVX-512, torch's bf16
   matrix product is a scalar loop, ~100x slower at this vocabulary's output layer; the bf16 path
   at tiny width is tests/test_journey.py's);
4. ``export``: ``tools/convert_megatron_to_hf.py`` of the SFT checkpoint;
5. ``serve``: a real vLLM CPU server (``.venv-vllm``, ``make venv``) serving the export, with the
   project's weight-transfer engine;
6. ``gppo``: 3 steps of 2 prompts x 4 responses of 128 tokens (``--quick``: 1 step of 1 x 2 of 8)
   of ``python -m megatron_klear rl`` with the shipped GPPO config, ``rollout.engine=vllm``,
   the weights streamed to the server after every step over an update group (``distributed``: the
   in-memory path for dedicated servers) and the probe check after every push (at lr 1e-3, so that
   every step changes the weights the server must then hold);
7. ``resume``: the same command one step further: it resumes from the RL checkpoint (not with
   ``--quick``: the tiny-model tests resume RL runs, and this phase was a fifth of the quick run);
8. ``eval``: ``tools/eval.py --server vllm`` on held-out prompts.

Per phase: wall time, the peak resident set of the largest process and the peak proportional set
size of all of them together (the phase's processes and the server: RSS looked at every 0.2 s,
PSS as often as 1/10 of a core allows; shared pages counted once), tokens/s where tokens are trained
(SFT: real tokens; GPPO: trained samples' tokens), and for GPPO the weight sync's bytes and time.
The ratio against a baseline of the same run: GPPO's push against the disk route a run without the
update protocol takes (the ``export`` phase plus the ``serve`` phase: a server started on the export).
Progress goes to stderr with an ETA from the phases' expected shares; the table to stdout and to
``--json``. The model is random: the rewards say nothing, the figures are the point.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_CONFIG = os.path.join(REPO, "examples/configs/sft_qwen3_8b.yaml")
GPPO_CONFIG = os.path.join(REPO, "examples/configs/gppo_qwen3_8b_math.yaml")
VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")


def qwen3_0_6b(layers: int) -> dict:
    """make_tiny_model's arguments for Qwen3-0.6B's config.json (benchmarks/convert.py holds it) with
    ``layers`` of its layers."""
    from convert import QWEN3_0_6B as c  # benchmarks/convert.py (this script's directory is on sys.path)

    return dict(
        num_layers=layers,
        hidden_size=c["hidden_size"],
        num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        rope_theta=1_000_000.0,
        max_position_embeddings=c["max_position_embeddings"],
        tied=c["tie_word_embeddings"],
        init_std=0.02,
        max_shard_size="512MB",
        flavor="base",
    )


PHASES = ("make", "convert", "sft", "export", "serve", "gppo", "resume", "eval")
#: each phase's share of the run (the full run of 2026-12-06, benchmarks/RESULTS.md), for the ETA
SHARES = {"make": 2, "convert": 1, "sft": 34, "export": 1, "serve": 3, "gppo": 33, "resume": 17, "eval": 9}


class RSSSampler:
    """Peak memory of a process tree (this process's descendants and ``extra`` roots), looked at every
    ``interval`` seconds in a thread: the largest process's resident set and the proportional set
    size of them all, the peaks of each. A PSS read walks the process's page tables (~75 ms for
    4 GiB here, in the reader's system time): summed over the tree every 0.2 s it took most of a
    core from the phase it measured, so the next sum waits ``PSS_COST_FACTOR`` times as long as the
    last one took (at most ~1/10 of a core)."""

    PSS_COST_FACTOR = 10

    def __init__(self, interval: float = 0.2):
        self.interval, self.extra = interval, set()
        self.peak_one = self.peak_all = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _pss(pid: int) -> int:
        """The proportional set size (shared pages divided among their users): what a sum may add."""
        with contextlib.suppress(OSError):  # (a process that ended meanwhile holds nothing)
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        return 0

    @staticmethod
    def _tree(roots: set) -> dict:
        parents, rss = {}, {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parents[int(pid)] = int(fields[1])
                rss[int(pid)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        members, grew = set(roots), True
        while grew:
            grew = False
            for pid, parent in parents.items():
                if parent in members and pid not in members:
                    members.add(pid)
                    grew = True
        return {pid: rss[pid] for pid in members if pid in rss and pid != os.getpid()}

    def _run(self) -> None:
        next_pss = 0.0
        while not self._stop.wait(self.interval):
            sizes = self._tree({os.getpid(), *self.extra})
            if not sizes:
                continue
            self.peak_one = max(self.peak_one, max(sizes.values()))
            if time.monotonic() >= next_pss:
                t0 = time.monotonic()
                self.peak_all = max(self.peak_all, sum(self._pss(pid) for pid in sizes))
                next_pss = time.monotonic() + self.PSS_COST_FACTOR * (time.monotonic() - t0)


def _run(cmd: list, log: str, env: dict | None = None, timeout: float = 7200) -> None:
    """Run ``cmd`` (output to ``log``); raises with the log's end when it fails."""
    with open(log, "w") as out:
        proc = subprocess.run(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, timeout=timeout
        )
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"journey: {' '.join(cmd[:6])} ... failed (exit {proc.returncode}); {log} ends:\n{tail}")


def _torchrun(args: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def _metrics(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Journey:
    def __init__(self, args):
        self.args, self.work = args, args.workdir
        self.rows, self.server = [], None
        self.t0 = time.monotonic()
        self.env = {"WANDB_MODE": "offline", "WANDB_DIR": self.work, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}

    def path(self, *parts) -> str:
        return os.path.join(self.work, *parts)

    @property
    def phases(self) -> tuple:
        return tuple(p for p in PHASES if p != "resume") if self.args.quick else PHASES

    def progress(self, phase: str, done: bool) -> None:
        finished = self.phases[: self.phases.index(phase) + (1 if done else 0)]
        share = sum(SHARES[p] for p in finished) / sum(SHARES[p] for p in self.phases)
        spent = time.monotonic() - self.t0
        eta = f", ETA {spent / share - spent:.0f} s" if share > 0.02 else ""
        word = "done" if done else "starting"
        count = f"{len(finished)}/{len(self.phases)} phases"
        print(f"journey: {phase} {word} ({count}, {spent:.0f} s{eta})", file=sys.stderr)

    def phase(self, name: str, fn) -> None:
        self.progress(name, done=False)
        with RSSSampler() as rss:
            if self.server is not None:
                rss.extra.add(self.server.proc.pid)
            start = time.monotonic()
            figures = fn() or {}
            seconds = time.monotonic() - start
        self.rows.append(
            {"phase": name, "seconds": seconds, "peak_rss_one": rss.peak_one, "peak_pss_all": rss.peak_all, **figures}
        )
        self.progress(name, done=True)

    # -- the phases -----------------------------------------------------------------------------------
    def make(self):
        shape = qwen3_0_6b(2 if self.args.quick else 28)
        code = (
            "import json, sys; from megatron_klear.models.tiny import make_tiny_model; "
            "make_tiny_model(sys.argv[1], **json.loads(sys.argv[2]))"
        )
        _run([sys.executable, "-c", code, self.path("hf-base"), json.dumps(shape)], self.path("make.log"))
        return {"layers": shape["num_layers"]}

    def convert(self):
        cmd = [sys.executable, "tools/convert_hf_to_megatron.py", "--hf-dir", self.path("hf-base")]
        _run(cmd + ["--out", self.path("mg-base"), "--tp", "2"], self.path("convert.log"))

    def sft(self):
        from megatron_klear.data.synthetic import write_sft_jsonl

        seq = self.args.seq_length
        write_sft_jsonl(self.path("sft.jsonl"), self.args.sft_examples, seed=0)
        cmd = [sys.executable, "tools/preprocess_sft.py", "--input", self.path("sft.jsonl")]
        cmd += ["--tokenizer", self.path("hf-base"), "--output-prefix", self.path("sft-data"), "--max-length", str(seq)]
        _run(cmd, self.path("preprocess.log"))
        steps = self.args.sft_steps
        args = ["-m", "megatron_klear", "sft", "--config", SFT_CONFIG, f"model.path={self.path('mg-base')}"]
        args += [f"data.prefix={self.path('sft-data')}", f"data.seq_length={seq}", "data.micro_batches_per_step=1"]
        args += ["parallel.cp=1", "train.epochs=0", f"train.steps={steps}", f"train.save_interval={steps}"]
        args += [f"train.save_dir={self.path('sft-run')}", "optim.warmup_steps=1", f"model.dtype={self.args.dtype}"]
        _run(_torchrun(args), self.path("sft.log"), self.env)
        rows = [m for m in _metrics(self.path("sft-run", "metrics.jsonl")) if "tokens_per_s" in m]
        timed = rows[1:] or rows  # (the first step compiles and allocates)
        return {"tokens_per_s": sum(m["tokens_per_s"] for m in timed) / len(timed), "steps": len(rows)}

    def export(self):
        ckpt = self.path("sft-run", f"iter_{self.args.sft_steps:07d}")
        _run(
            [sys.executable, "tools/convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", self.path("hf-sft")],
            self.path("export.log"),
        )

    def serve(self):
        from megatron_klear.rollout.vllm.launcher import VLLMServer

        transfer = ("--weight-transfer-config", '{"backend": "megatron_klear"}')
        self.server = VLLMServer.launch(
            self.path("hf-sft"), python=self.args.vllm_python, max_model_len=2048, extra_args=transfer
        )
        return {"url": self.server.url}

    def _gppo(self, steps: int):
        from megatron_klear.data.synthetic import write_rl_prompts_jsonl

        if not os.path.exists(self.path("rl.jsonl")):
            write_rl_prompts_jsonl(self.path("rl.jsonl"), 64, seed=1)
        ckpt = self.path("sft-run", f"iter_{self.args.sft_steps:07d}")
        args = ["-m", "megatron_klear", "rl", "--config", GPPO_CONFIG, f"model.path={ckpt}", "parallel.cp=1"]
        args.append(f"model.dtype={self.args.dtype}")
        prompts = self.args.prompts_per_step
        args += [f"rl.prompts=[{self.path('rl.jsonl')}]", f"rl.prompts_per_step={prompts}", "rl.oversample_prompts=4"]
        args += [f"rl.responses_per_prompt={self.args.responses_per_prompt}", f"rl.mini_batch_prompts={prompts}"]
        args += ["rl.max_tokens_per_micro_batch=2048"]
        args += [
            "rl.max_prompt_length=256",
            f"rollout.max_new_tokens={self.args.max_new_tokens}",
            "rl.filter_zero_spread=false",
        ]
        args += ["rollout.engine=vllm", f"rollout.urls=[{self.server.url}]", "rollout.verify_interval=1"]
        # a learning rate that changes the weights at every step (Adam's step, ~lr on every weight
        # with a gradient, and at least the weight decay, lr x 0.1): the probe after the push then
        # compares the server against weights it did not start from (the shipped 1e-6, warmed up from
        # 0, left the weights where the server's are, and the probe passed with nothing pushed)
        args += ["optim.lr=1e-3", "optim.min_lr=1e-3", "optim.warmup_steps=0"]
        args += [
            "reward.workers=1",
            f"train.steps={steps}",
            f"train.save_interval={steps}",
            f"train.save_dir={self.path('rl-run')}",
        ]
        _run(_torchrun(args), self.path(f"gppo-{steps}.log"), self.env)
        rows = [m for m in _metrics(self.path("rl-run", "metrics.jsonl")) if "step" in m]
        first = steps - (self.args.gppo_steps if steps == self.args.gppo_steps else 1)  # (resume: its one step)
        mine = [m for m in rows if m["step"] > first]
        out = {"steps": [m["step"] for m in mine]}
        # generated tokens/s (the server), samples/s (the step, generation to push), the update's time
        out["tokens_per_s"] = sum(m.get("rollout/tokens_per_s", 0.0) for m in mine) / len(mine)
        out["samples_per_s"] = sum(m.get("perf/samples_per_s", 0.0) for m in mine) / len(mine)
        out["train_s"] = sum(m.get("time/train_s", 0.0) for m in mine) / len(mine)
        out["lr"] = min(m.get("lr", 0.0) for m in mine)
        out["optimizer_steps"] = sum(m.get("actor/optimizer_steps", 0) for m in mine)
        out["weights_version"] = mine[-1].get("weights/version")
        syncs = [m for m in mine if m.get("weights/pushed")]
        if syncs:
            out["sync_bytes"] = syncs[-1].get("weights/sync_bytes")
            out["sync_s"] = sum(m["time/weight_sync_s"] for m in syncs) / len(syncs)
            out["probe_max"] = max(m.get("weights/verify_mean_diff_max", float("nan")) for m in syncs)
        return out

    def gppo(self):
        return self._gppo(self.args.gppo_steps)

    def resume(self):
        return self._gppo(self.args.gppo_steps + 1)

    def eval(self):
        from megatron_klear.data.synthetic import write_rl_prompts_jsonl

        write_rl_prompts_jsonl(self.path("heldout.jsonl"), 16, seed=2, split="heldout")
        cmd = [sys.executable, "tools/eval.py", "--url", self.server.url, "--server", "vllm"]
        cmd += ["--tokenizer", self.path("hf-sft"), "--bench", f"heldout={self.path('heldout.jsonl')}", "--k", "1"]
        cmd += ["--max-new-tokens", str(self.args.max_new_tokens), "--output", self.path("eval.json")]
        _run(cmd, self.path("eval.log"))
        return {"prompts": 16}

    def run(self) -> list:
        try:
            for name in self.phases:
                self.phase(name, getattr(self, name))
        finally:
            if self.server is not None:
                self.server.close()
        return self.rows


def table(rows: list) -> str:
    gib = 2**30
    lines = [
        "| phase | seconds | peak RSS, largest process (GiB) | peak PSS, all (GiB) | tokens/s | weight sync |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
        if "samples_per_s" in r:  # GPPO: generated tokens/s, then the step's samples/s and update time
            tps += f" generated; {r['samples_per_s']:.2f} samples/s, update {r['train_s']:.1f} s a step"
        else:
            tps += " trained" if tps else ""
        sync = (
            f"{r['sync_bytes'] / 1e9:.2f} GB in {r['sync_s']:.2f} s, probe {r['probe_max']:.2g}"
            if "sync_bytes" in r
            else ""
        )
        rss = f"{r['peak_rss_one'] / gib:.2f} | {r['peak_pss_all'] / gib:.2f}"
        lines.append(f"| {r['phase']} | {r['seconds']:.1f} | {rss} | {tps} | {sync} |")
    return "\n".join(lines)


def push_ratio(rows: list) -> dict | None:
    """The run's baseline: GPPO's mean push time against what a run without the update protocol does
    to get new weights into a server, measured in the same run: export the checkpoint to HF, start a
    server on it (the ``export`` and ``serve`` phases). None when no push happened."""
    by = {r["phase"]: r for r in rows}
    if "sync_s" not in by.get("gppo", {}):
        return None
    disk = by["export"]["seconds"] + by["serve"]["seconds"]
    return {
        "push_s": by["gppo"]["sync_s"],
        "export_s": by["export"]["seconds"],
        "serve_s": by["serve"]["seconds"],
        "ratio": by["gppo"]["sync_s"] / disk,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers of the same width, shorter rows and responses")
    ap.add_argument("--workdir", default="", help="default: a temporary directory, removed at the end")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="",
        help="the trainers' model.dtype (default: the shipped configs' bf16; fp32 with --quick)",
    )
    args = ap.parse_args(argv)
    if not os.path.exists(args.vllm_python):
        ap.error(f"vLLM's CPU build is not installed ({args.vllm_python}): run make venv")
    # --quick keeps the width (the shapes users' checkpoints have) and trains few tokens in fp32: at
    # this vocabulary the output layer's GEMM is most of a step, and a CPU without native bf16 (AVX2
    # only) runs it in bf16 ~100x slower than in fp32 (docs/training.md, CPU runs). The shipped
    # configs' bf16 is the tiny journey's (tests/test_journey.py) and the full run's.
    args.dtype = args.dtype or ("fp32" if args.quick else "bf16")
    args.seq_length = 64 if args.quick else 4096  # (one synthetic example, 53-58 tokens, a row)
    args.sft_steps, args.gppo_steps = (1, 1) if args.quick else (3, 3)
    args.sft_examples = 16 if args.quick else 512
    args.max_new_tokens = 8 if args.quick else 128
    args.prompts_per_step, args.responses_per_prompt = (1, 2) if args.quick else (2, 4)
    keep = bool(args.workdir)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="klear-journey-")
    os.makedirs(args.workdir, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        rows = Journey(args).run()
    finally:
        if not keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    layers = rows[0].get("layers")
    print(
        f"Qwen3-0.6B's shapes, {layers} layers, vocabulary 151,936 (the tiny tokenizer's tokens, the rest padding), "
        f"TP=2 under torchrun in {args.dtype}, one vLLM CPU server; "
        f"{started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores"
    )
    print(table(rows))
    print(f"total {sum(r['seconds'] for r in rows):.0f} s")
    ratio = push_ratio(rows)
    if ratio:
        print(
            f"weights into the server: a push {ratio['push_s']:.1f} s against the disk route measured in this run "
            f"(export {ratio['export_s']:.1f} s + a server started on the export {ratio['serve_s']:.1f} s): "
            f"{ratio['ratio']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": started.isoformat(),
                    "quick": args.quick,
                    "dtype": args.dtype,
                    "rows": rows,
                    "push_ratio": ratio,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
