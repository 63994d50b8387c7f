"""tools/plot_run.py: one readable PNG per chart (matplotlib), several runs in one chart, bad lines named."""
import json

import pytest

pytest.importorskip("matplotlib")


def _write_run(root, name, scale):
    run = root / name
    run.mkdir()
    rows = [{"step": i, "loss": scale * 5.0 / i, "actor/clip_frac_low": 0.01 * i, "actor/clip_frac_high": 0.02 * i}
            for i in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(run / "metrics.jsonl")


def _image(path):
    import matplotlib.image as mpimg

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.01  # something is drawn on the white canvas
    return img


def test_two_runs_as_png(tmp_path):
    from tools.plot_run import main

    a, b = _write_run(tmp_path, "a", 1.0), _write_run(tmp_path, "b", 2.0)
    out = tmp_path / "plots"
    assert main([a, b, "--out", str(out), "--metric", "loss",
                 "--group", "clip=actor/clip_frac_low,actor/clip_frac_high"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["clip.png", "loss.png"]
    _image(out / "loss.png")
    _image(out / "clip.png")
    # one run draws less than two runs (different pixels): both runs are on the chart
    single = tmp_path / "single"
    assert main([a, "--out", str(single), "--metric", "loss"]) == 0
    assert (_image(single / "loss.png").shape != _image(out / "loss.png").shape
            or (_image(single / "loss.png") != _image(out / "loss.png")).any())


def test_svg_on_request(tmp_path):
    from tools.plot_run import main

    a = _write_run(tmp_path, "a", 1.0)
    assert main([a, "--out", str(tmp_path / "o"), "--metric", "loss", "--format", "svg"]) == 0
    assert (tmp_path / "o" / "loss.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def test_bad_line_is_named(tmp_path, capsys):
    from megatron_klear.platform.entry import run_entry_point
    from tools.plot_run import main

    bad = tmp_path / "m.jsonl"
    bad.write_text('{"step": 1, "loss": 1}\n{oops\n')
    assert run_entry_point(main, [str(bad), "--out", str(tmp_path / "o"), "--metric", "loss"]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
