"""The Slurm submit lines of README.md and docs/ are ones that run: each names a script, sets only
variables the script reads, starts SGLang from SGLang's environment (``SERVER_PY`` and
``ROUTER_PY``: the trainer's ``python`` has no SGLang, and the job refuses it before any step), and
asks for the nodes the script's layout uses (the job refuses another count). The smoke job's line is
the one ``make test-slurm`` submits (tests/slurm/test_slurm_smoke.py)."""

import os

import pytest

from tests.slurm.submit_lines import ROOT, submit_lines, variables_read

LINES = submit_lines()
# variables a submit line may set that no script reads itself: they reach the roles' programs
PASSED_ON = {"WANDB_MODE", "WANDB_API_KEY", "HF_HOME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME"}


def test_the_manual_has_submit_lines_of_every_script():
    scripts = {s.script for s in LINES}
    shipped = {f"examples/slurm/{n}" for n in os.listdir(os.path.join(ROOT, "examples/slurm")) if n.endswith(".sbatch")}
    assert scripts == shipped, (sorted(scripts), sorted(shipped))
    assert any(s.page == "README.md" and s.script.endswith("gppo_qwen3_8b.sbatch") for s in LINES)
    assert any(s.page == "docs/slurm.md" and s.script.endswith("smoke.sbatch") for s in LINES)


@pytest.mark.parametrize("sub", LINES, ids=[f"{s.page}:{s.line}" for s in LINES])
def test_each_submit_line_sets_what_its_script_reads(sub):
    where = f"{sub.page}:{sub.line}: {sub.text}"
    assert os.path.exists(os.path.join(ROOT, sub.script)), where
    unread = set(sub.env) - variables_read(sub.script) - PASSED_ON
    assert not unread, f"{where}: {sorted(unread)} are not read by {sub.script}"
    if sub.script.endswith(("gppo_qwen3_8b.sbatch", "eval.sbatch", "smoke.sbatch")):
        engine = sub.env.get("ENGINE", "sglang")
        needed = {"sglang": {"SERVER_PY", "ROUTER_PY"}, "vllm": {"SERVER_PY"}}.get(engine, set())
        missing = needed - set(sub.env)
        assert not missing, f"{where}: the servers would start with the trainer's python: set {sorted(missing)}"
    nodes = [a.split("=", 1)[1] for a in sub.sbatch_args if a.startswith("--nodes=")]
    if nodes and sub.script.endswith("gppo_qwen3_8b.sbatch"):
        want = int(sub.env.get("ROLLOUT_NODES", 1)) + int(sub.env.get("TRAIN_NODES", 2))
        assert int(nodes[0]) == want, f"{where}: --nodes={nodes[0]}, the layout uses {want}"
    if nodes and sub.script.endswith("smoke.sbatch"):
        assert nodes[0] == "2", where


def test_the_reader_catches_a_line_that_would_not_run(tmp_path):
    """The checks above fail on what they are for: a GPPO line without SERVER_PY, one with a
    variable no script reads, one whose --nodes is not the layout's."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nexport TRAIN_ARGS=x\nsbatch --nodes=6 --export=ALL examples/slurm/gppo_qwen3_8b.sbatch\n"
        "SERVR_PY=/x sbatch examples/slurm/eval.sbatch\n```\n"
    )
    got = submit_lines([str(page)])
    assert [s.env for s in got] == [{"TRAIN_ARGS": "x"}, {"TRAIN_ARGS": "x", "SERVR_PY": "/x"}]  # exports persist
    for sub in got:
        with pytest.raises(AssertionError):
            test_each_submit_line_sets_what_its_script_reads(sub)
    assert "SERVR_PY" not in variables_read("examples/slurm/eval.sbatch")
