"""Errors at the end of the output, named inputs, launch hints, no orphans (issue 13, items 4-6, 8)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_klear.config import ConfigError, load_config
from tests.launch import launch_env, start_torchrun, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


# -- item 4: config errors ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,hint",
    [
        ("trian.steps=3", "train.steps"),  # a misspelt section
        ("paralel.tp=2", "parallel.tp"),
        ("reward.sandbx.isolation=bwrap", "reward.sandbox.isolation"),
        ("train.stpes=3", "train.steps"),  # a misspelt key (as before)
    ],
)
def test_misspelt_sections_get_a_suggestion(override, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == f"command line: unknown key '{override.split('=')[0]}' (did you mean '{hint}'?)"


def test_the_head_count_is_reported_before_the_padding_it_causes(tiny_hf):
    """tp=3 on 4 heads / 2 KV heads used to report `seq_length 512 must be a multiple of
    pad_to_multiple 3`; the cause is the head split."""
    from megatron_klear.sft.trainer import preflight

    cfg = load_config(
        None, [f"model.path={tiny_hf['untied']}", "parallel.tp=3", "data.seq_length=512", "data.prefix=unused"]
    )
    with pytest.raises(ValueError) as e:
        preflight(cfg)
    assert str(e.value) == (
        f"parallel.tp=3 does not divide model.path={tiny_hf['untied']}'s num_attention_heads=4 "
        "and num_key_value_heads=2: each tensor-parallel rank must hold whole attention heads "
        "and KV groups; parallel.tp can be 1, 2"
    )


def test_a_derived_number_says_where_it_comes_from(tiny_hf, tmp_path):
    from megatron_klear.sft.trainer import preflight

    model = str(tmp_path / "six-heads")
    shutil.copytree(tiny_hf["untied"], model)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config.update(num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = load_config(None, [f"model.path={model}", "parallel.tp=3", "data.seq_length=512", "data.prefix=unused"])
    with pytest.raises(
        ConfigError,
        match=r"^data.seq_length=512 must be a multiple of 3 \(the padding every rank "
        r"needs with parallel.tp=3, parallel.cp=1, training/batches.py",
    ):
        preflight(cfg)
    cfg.data.pad_to_multiple = 6
    with pytest.raises(ConfigError, match=r"a multiple of 6 \(data.pad_to_multiple=6, "):
        preflight(cfg)


def test_an_empty_data_prefix_is_refused_before_any_process(tiny_hf):
    from megatron_klear.sft.trainer import preflight

    cfg = load_config(None, [f"model.path={tiny_hf['untied']}", "data.seq_length=512"])
    with pytest.raises(ConfigError, match=r"^data.prefix is empty: run tools/preprocess_sft.py first"):
        preflight(cfg)


def test_one_process_prints_one_line_and_no_traceback():
    r = subprocess.run(
        [PY, "-m", "megatron_klear", "sft", "trian.steps=3"],
        capture_output=True,
        text=True,
        env=launch_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 2
    out = (r.stdout + r.stderr).strip()
    assert "Traceback" not in out, out
    assert out.splitlines()[-1] == "error: command line: unknown key 'trian.steps' (did you mean 'train.steps'?)"


def test_under_torchrun_the_message_is_printed_once_and_ends_torchruns_summary():
    """Every rank fails the same way: rank 0 prints the line; no rank prints a traceback; torchrun's
    own failure summary (its ChildFailedError, which no child can suppress) ends with the message
    from the ranks' error files instead of "To enable traceback see ..."."""
    message = "command line: unknown key 'trian.steps' (did you mean 'train.steps'?)"
    rc, out = torchrun("-m", "megatron_klear", "sft", "trian.steps=3")
    assert rc != 0
    assert out.count(f"error: {message}") == 1, out
    assert "megatron_klear" not in "".join(ln for ln in out.splitlines() if ln.strip().startswith("File ")), out
    assert "ConfigError" not in out and "To enable traceback" not in out, out
    # torchrun's "Root Cause" is the earliest failure (one-second timestamps, ties to the first
    # listed): sometimes rank 1, terminated by torchrun before it wrote its error file
    causes = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("traceback :")]
    assert f"traceback : {message}" in causes, out


def test_under_plain_torchrun_a_rank_other_than_0_waits_for_rank_0_to_print(tmp_path, monkeypatch, capsys):
    """The torchrun test above failed once: rank 1 met the bad key first, torchrun ended rank 0 at
    rank 1's exit, and no rank printed the line. A rank other than 0 now waits before its exit
    (torchrun ends it when rank 0 has printed and left); rank 0, and every rank under the project's
    launcher (which prints the line itself), exits at once."""
    from megatron_klear.platform import entry

    slept = []
    monkeypatch.setattr(entry.time, "sleep", slept.append)

    def bad_key():
        raise ValueError("command line: unknown key 'x'")

    for rank, launcher, waits in ((1, "", True), (0, "", False), (1, "1", False)):
        slept.clear()
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error{rank}{launcher}.json"))
        monkeypatch.setenv("KLEAR_LAUNCHER", launcher)
        assert entry.run_entry_point(bad_key) == 2
        printed = capsys.readouterr().err.strip()
        assert slept == ([entry.RANK0_GRACE_S] if waits else []), (rank, launcher)
        assert printed == ("error: command line: unknown key 'x'" if rank == 0 and not launcher else ""), printed
        with open(tmp_path / f"error{rank}{launcher}.json") as f:  # the message is in the error file either way
            assert json.load(f)["message"]["message"] == "command line: unknown key 'x'"


def _launch(*args, timeout=300):
    """``python -m megatron_klear.platform.launch`` (torchrun's arguments) at 2 ranks; (status, output lines)."""
    rc, out = torchrun(*args, launcher="megatron_klear.platform.launch", timeout=timeout)
    return rc, out.strip().splitlines()


@pytest.mark.parametrize("case", ["key", "type", "data"])
def test_under_the_launcher_a_user_error_is_the_last_line_and_status_2(case, tiny_hf, tmp_path):
    """Issue 20 item 2: under plain torchrun the line was followed by torchrun's ChildFailedError
    traceback and summary (the message three times), the last line '=====', status 1."""
    overrides, message = {
        "key": (["trian.steps=3"], "command line: unknown key 'trian.steps' (did you mean 'train.steps'?)"),
        "type": (["train.steps=abc"], "command line: key 'train.steps' expects int, got 'abc'"),
        "data": (
            [f"model.path={tiny_hf['untied']}", f"data.prefix={tmp_path}/nodata", f"train.save_dir={tmp_path}/run"],
            f"{tmp_path}/nodata.meta.json not found: '{tmp_path}/nodata' is not a preprocessed SFT dataset",
        ),
    }[case]
    rc, lines = _launch("-m", "megatron_klear", "sft", "--config", "examples/configs/sft_tiny_cpu.yaml", *overrides)
    out = "\n".join(lines)
    assert (rc, lines[-1]) == (2, f"error: {message}"), out
    assert out.count("error:") == 1 and "Traceback" not in out and "ChildFailedError" not in out, out


def test_a_rank_that_saw_another_rank_fail_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """Issue 20 item 6: rank 1 printed gloo's "Connection closed by peer" traceback as if it were
    a cause; the launcher (and torchrun's summary) must take rank 0's failure as the root cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from megatron_klear.platform.entry import run_entry_point
    from megatron_klear.platform.launch import report

    def gloo_fails():
        raise RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"
        )

    def server_fails():
        raise RuntimeError("rollout: POST http://127.0.0.1:1/generate failed: ConnectError")

    monkeypatch.delenv("KLEAR_LAUNCHER", raising=False)
    files = {}
    for rank, fn in ((1, gloo_fails), (0, server_fails)):
        files[rank] = str(tmp_path / f"error{rank}.json")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[rank])
        if rank == 1:
            assert run_entry_point(fn) == 1
            assert capsys.readouterr().err.strip().splitlines() == [
                "rank 1 stopped: a collective operation failed (RuntimeError: [../third_party/gloo/gloo/transport/"
                "tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500), most likely because another rank "
                "failed first; see that rank's error"
            ]
        else:
            with pytest.raises(RuntimeError, match="rollout: POST"):
                run_entry_point(fn)
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file=f) for r, f in files.items()}
    failures[1].timestamp -= 5  # rank 1 noticed first
    failures[2] = ProcessFailure(local_rank=2, pid=102, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none"))
    failures[2].timestamp = failures[1].timestamp  # and torchrun terminated rank 2 as soon as it did
    error = ChildFailedError("megatron_klear.rl", failures)
    assert report(error) == 1
    summary = capsys.readouterr().err
    root = summary.split("Root Cause")[1]
    assert "rank      : 0" in root and "rollout: POST http://127.0.0.1:1/generate" in root, summary
    assert "Traceback" in root  # rank 0's own, recorded in its error file


# -- item 5: launch hints ---------------------------------------------------------------------------
def test_check_parity_without_torchrun_says_how_to_launch_it():
    args = ["--hf-dir", "/models/x", "--tp", "2", "--pp", "2"]
    r = subprocess.run(
        [PY, "tools/check_parity.py", *args], capture_output=True, text=True, env=launch_env(), cwd=ROOT, timeout=120
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --tp 2 --pp 2 needs 4 processes, one per rank; launch them with",
        "  torchrun --nproc-per-node 4 tools/check_parity.py --hf-dir /models/x --tp 2 --pp 2",
    ]


# -- item 6: unreadable input files are named -------------------------------------------------------
def _truncate(path, keep=0.5):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


def _single_file_copy(src, dst):
    """``src`` (sharded) as one model.safetensors."""
    from safetensors.torch import save_file

    from megatron_klear.checkpoint.hf_io import HFReader

    shutil.copytree(src, dst)
    reader = HFReader(dst)
    tensors = {k: reader.get(k) for k in reader.keys()}
    for fname, _ in reader.files():
        os.remove(os.path.join(dst, fname))
    os.remove(os.path.join(dst, "model.safetensors.index.json"))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_a_truncated_safetensors_file_is_named(tiny_hf, tmp_path):
    from megatron_klear.checkpoint.hf_io import HFReader

    hf = _single_file_copy(tiny_hf["untied"], str(tmp_path / "hf"))
    _truncate(os.path.join(hf, "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=rf"^{hf}/model.safetensors: cannot read this safetensors file "
        r"\(tensor '[^']+' ends past the end of the file.*\); it is probably truncated",
    ):
        HFReader(hf)


def test_a_truncated_shard_is_named_when_read(tiny_hf, tmp_path):
    from megatron_klear.checkpoint.hf_io import HFReader

    hf = str(tmp_path / "sharded")
    shutil.copytree(tiny_hf["untied"], hf)
    reader = HFReader(hf)
    (_, first_keys), (last, last_keys) = reader.files()[0], reader.files()[-1]
    _truncate(os.path.join(hf, last))
    reader.get(first_keys[0])
    with pytest.raises(ValueError, match=rf"^{hf}/{last}: cannot read this safetensors file"):
        reader.get(last_keys[0])


def test_convert_cli_prints_one_line_naming_the_file(tiny_hf, tmp_path, capsys):
    sys.path.insert(0, ROOT)
    try:
        from tools.convert_hf_to_megatron import main
    finally:
        sys.path.remove(ROOT)
    hf = str(tmp_path / "hf")
    shutil.copytree(tiny_hf["untied"], hf)
    shard = sorted(n for n in os.listdir(hf) if n.endswith(".safetensors"))[-1]
    _truncate(os.path.join(hf, shard))
    assert main(["--hf-dir", hf, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # (after Megatron's import warnings)
    assert err.strip().splitlines()[-1].startswith(f"error: {hf}/{shard}: cannot read this safetensors file"), err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "out")


def test_corrupt_dataset_and_tokenizer_files_are_named(tiny_hf, tmp_path):
    from megatron_klear.data.chat import load_tokenizer
    from megatron_klear.data.indexed import load_metadata, meta_path

    prefix = str(tmp_path / "data")
    with open(meta_path(prefix), "w") as f:
        f.write('{"format": "megatron_klear.sft", "num_ex')
    with pytest.raises(ValueError, match=rf"^{meta_path(prefix)}: unreadable dataset metadata"):
        load_metadata(prefix)
    tok = str(tmp_path / "tok")
    shutil.copytree(tiny_hf["untied"], tok)
    _truncate(os.path.join(tok, "tokenizer.json"), 0.3)
    with pytest.raises(ValueError, match=rf"^{tok}: cannot load the tokenizer"):
        load_tokenizer(tok)


# -- item 8: no orphans -------------------------------------------------------------------------------
def _gone(pid, timeout=20.0):
    """Whether ``pid`` exits (or is a zombie: killed, not yet reaped) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


def _kill_if_alive(*pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass


def _start(script, *args, **kw):
    p = subprocess.Popen(
        [PY, "-c", textwrap.dedent(script), *args], stdout=subprocess.PIPE, text=True, env=launch_env(), cwd=ROOT, **kw
    )
    return p, json.loads(p.stdout.readline())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_grading_worker_stuck_in_c_code_dies_with_the_trainer():
    p, info = _start("""
        import json, time
        from megatron_klear.rewards import GradingPool, RewardConfig
        pool = GradingPool(RewardConfig(math_timeout_s=5), workers=1)
        item = {"id": 1, "task": "math", "response": "<think>x</think> 1", "answer": "1"}
        pool.submit(item).result(timeout=60)
        worker = pool._workers[0].proc.pid
        forkserver = int(open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[1])
        print(json.dumps([worker, forkserver]), flush=True)
        time.sleep(120)
    """)
    try:
        worker, forkserver = info
        assert forkserver != p.pid  # forked by the forkserver, which every worker keeps alive
        os.kill(worker, signal.SIGSTOP)  # busy where no signal handler runs: it would never see EOF
        p.kill()
        p.wait()
        assert _gone(forkserver), "the grading pool's forkserver outlived the trainer"
        assert _gone(worker), "the grading worker outlived the trainer"
    finally:
        _kill_if_alive(p.pid, *info)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_torchrun(tmp_path):
    """torchrun starts each rank in its own session: killing torchrun (or its process group) used
    to leave the ranks training on and writing checkpoints."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        from megatron_klear.platform.entry import run_entry_point

        def main():
            with open(sys.argv[1] + f".{os.environ['RANK']}", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)

        sys.exit(run_entry_point(main))
    """)
    )
    pids = str(tmp_path / "pid")
    p = start_torchrun(str(script), pids, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [
                int(open(f"{pids}.{r}").read())
                for r in (0, 1)
                if os.path.exists(f"{pids}.{r}") and open(f"{pids}.{r}").read()
            ]
            time.sleep(0.2)
        assert len(ranks) == 2, "the ranks did not start"
        assert not any(_gone(pid, timeout=1.0) for pid in ranks)  # alive while torchrun is
        p.kill()
        p.wait()
        assert all(_gone(pid) for pid in ranks), "ranks outlived torchrun"
    finally:
        _kill_if_alive(p.pid, *ranks)


# -- issue 20 item 6: a wrong shape names the file ----------------------------------------------------
def test_a_tensor_that_does_not_fit_the_config_names_its_file(tiny_hf, tmp_path):
    from megatron_klear.checkpoint.convert import hf_to_megatron

    hf = str(tmp_path / "hf")
    shutil.copytree(tiny_hf["untied"], hf)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    config["hidden_size"] *= 2
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(
        ValueError,
        match=rf"^{hf}/model-\d+-of-\d+\.safetensors: tensor 'model\.embed_tokens\.weight' "
        rf"has shape .* from the config \({hf}/config\.json\)$",
    ):
        hf_to_megatron(hf, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_a_code_item_whose_tests_do_not_match_is_a_bad_line_not_a_zero(tmp_path, capsys):
    """It used to get reward 0.0, as if the response were wrong."""
    from megatron_klear.rewards.cli import grade_main

    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    with open(inp, "w") as f:
        f.write(
            json.dumps({"id": "c", "task": "code", "response": "print(1)", "tests": {"inputs": [], "outputs": ["1"]}})
            + "\n"
        )
    assert grade_main(["--input", inp, "--output", out, "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{inp}:1: tests: 0 inputs but 1 outputs" in err, err
    assert err.strip().splitlines()[-1].startswith("error: 1 malformed input line(s)"), err
    (record,) = [json.loads(line) for line in open(out)]
    assert record["reward"] is None and record["error"] == f"{inp}:1: tests: 0 inputs but 1 outputs"


@pytest.mark.parametrize("job", ["sft", "rl"])
def test_the_old_command_names_the_new_one(job):
    rc = subprocess.run(
        [PY, "-m", f"megatron_klear.{job}", "--config", "x.yaml"], capture_output=True, text=True, cwd=ROOT
    )
    assert rc.returncode == 1 and f"python -m megatron_klear {job} --config" in rc.stderr, rc.stderr


# -- issue 32 item 2 (in part): the free-space check before a conversion writes anything ---------------
def _tree_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_a_conversion_without_room_fails_before_writing_naming_the_bytes(tiny_hf, tmp_path, monkeypatch):
    """Each direction asks the output's filesystem for what it will write (HF -> Megatron: the staged
    tensors and the checkpoint; Megatron -> HF: the weights) and stops before writing a byte when it
    is not there. The figure is checked against what a real conversion then writes."""
    import re
    from collections import namedtuple

    from megatron_klear.checkpoint.convert import NotEnoughSpaceError, hf_to_megatron, megatron_to_hf
    from megatron_klear.checkpoint.formats import base

    mg, hf_out = tmp_path / "mg", tmp_path / "hf"
    hf_to_megatron(tiny_hf["untied"], str(mg), progress=False)
    megatron_to_hf(str(mg), str(hf_out), progress=False)
    written = {"to_megatron": _tree_bytes(mg), "to_hf": _tree_bytes(hf_out)}
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(base.shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 1000))
    asked = {}
    for name, call, out in (
        ("to_megatron", lambda o: hf_to_megatron(tiny_hf["untied"], o, progress=False), tmp_path / "mg2"),
        ("to_hf", lambda o: megatron_to_hf(str(mg), o, progress=False), tmp_path / "hf2"),
    ):
        with pytest.raises(
            NotEnoughSpaceError, match=r"needs [\d.]+ GB \(([\d,]+) bytes\) free.* \(1,000 bytes\)"
        ) as e:
            call(str(out))
        asked[name] = int(re.search(r"\(([\d,]+) bytes\) free", str(e.value)).group(1).replace(",", ""))
        assert str(tmp_path) in str(e.value)
        assert sorted(os.listdir(tmp_path)) == ["hf", "mg"]  # nothing written, no temporary left
    # HF -> Megatron writes the checkpoint once (no staging copy): the figure covers it, and not twice
    assert written["to_megatron"] <= asked["to_megatron"] <= 1.5 * written["to_megatron"], (asked, written)
    # Megatron -> HF: the weights (the vocabulary's padding counted), not less than what it writes
    assert written["to_hf"] * 0.9 <= asked["to_hf"] <= 1.5 * written["to_hf"], (asked, written)
