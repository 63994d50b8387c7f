"""tools/plot_run.py: one readable PNG per chart (matplotlib), several runs in one chart, bad lines named."""

import json

import pytest

pytest.importorskip("matplotlib")


def _write_run(root, name, scale):
    run = root / name
    run.mkdir()
    rows = [
        {"step": i, "loss": scale * 5.0 / i, "actor/clip_frac_low": 0.01 * i, "actor/clip_frac_high": 0.02 * i}
        for i in range(1, 11)
    ]
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
    assert (
        main([a, b, "--out", str(out), "--metric", "loss", "--group", "clip=actor/clip_frac_low,actor/clip_frac_high"])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["clip.png", "loss.png"]
    _image(out / "loss.png")
    _image(out / "clip.png")
    # one run draws less than two runs (different pixels): both runs are on the chart
    single = tmp_path / "single"
    assert main([a, "--out", str(single), "--metric", "loss"]) == 0
    assert (
        _image(single / "loss.png").shape != _image(out / "loss.png").shape
        or (_image(single / "loss.png") != _image(out / "loss.png")).any()
    )


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


def _write_async_run(root, name, rows):
    run = root / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(run / "metrics.jsonl")


def _async_rows(staleness):
    return [
        {
            "step": i,
            "rollout/staleness_mean": staleness * i / 10,
            "rollout/staleness_max": staleness,
            "rollout/offpolicy_token_frac": staleness * 0.1 * i,
            "rollout/resumed_samples": 3 * i,
            "rollout/aborted_samples": 2 * i,
            "rollout/stale_regenerated": i % 2,
            "perf/generate_s": 1.0 + i,
            "perf/train_s": 0.5 * i,
            "perf/overlap_s": 0.25 * i,
            "perf/step_s": 1.5 + i,
            "perf/samples_per_s": 10.0 / i,
        }
        for i in range(1, 8)
    ]


def test_async_preset_draws_the_new_metrics(tmp_path):
    from tools.plot_run import PRESETS, collect_series, main

    sync = _write_async_run(
        tmp_path,
        "sync",
        [{k: (0 if k.startswith("rollout/") and k != "step" else v) for k, v in r.items()} for r in _async_rows(0)],
    )
    async_ = _write_async_run(tmp_path, "async", _async_rows(1))
    out = tmp_path / "plots"
    assert main([sync, async_, "--out", str(out), "--preset", "async"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.png" for name in PRESETS["async"])
    for name in PRESETS["async"]:
        _image(out / f"{name}.png")
    # what a chart holds: every (run, metric) of its group, the values as logged
    from tools.plot_run import read_metrics

    runs = {"sync": read_metrics(sync), "async": read_metrics(async_)}
    times = collect_series(runs, PRESETS["async"]["async_times"])
    assert sorted(times) == sorted(
        f"{r}: perf/{m}_s" for r in ("sync", "async") for m in ("generate", "train", "overlap", "step")
    )
    assert times["async: perf/overlap_s"] == [(i, 0.25 * i) for i in range(1, 8)]
    assert collect_series(runs, ["rollout/staleness_max"])["async: rollout/staleness_max"] == [
        (i, 1) for i in range(1, 8)
    ]
    # one run: labelled by the metric alone; a metric no run logged is left out
    assert collect_series({"sync": runs["sync"]}, ["perf/samples_per_s", "nope"]) == {
        "perf/samples_per_s": [(i, 10.0 / i) for i in range(1, 8)]
    }


def test_async_preset_on_a_run_without_the_metrics(tmp_path, capsys):
    from tools.plot_run import main

    a = _write_run(tmp_path, "a", 1.0)  # a run from before the asynchronous metrics: nothing to draw
    assert main([a, "--out", str(tmp_path / "o"), "--preset", "async"]) == 1
    assert "warning: no values for ['rollout/staleness_mean', 'rollout/staleness_max']" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        main([a, "--out", str(tmp_path / "o"), "--preset", "nope"])
