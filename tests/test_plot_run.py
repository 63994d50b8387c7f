"""tools/plot_run.py: one SVG per chart, a polyline per series, bad lines named."""
import json
import xml.etree.ElementTree as ET


def test_plots_metrics_as_svg(tmp_path):
    from tools.plot_run import main

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "loss": 5.0 / i, "actor/clip_frac_low": 0.01 * i, "actor/clip_frac_high": 0.02 * i} for i in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plots"
    assert main([str(run / "metrics.jsonl"), "--out", str(out), "--metric", "loss",
                 "--group", "clip=actor/clip_frac_low,actor/clip_frac_high"]) == 0
    ns = {"s": "http://www.w3.org/2000/svg"}
    loss = ET.parse(out / "loss.svg").getroot()
    lines = loss.findall("s:polyline", ns)
    assert len(lines) == 1 and len(lines[0].get("points").split()) == 10
    ys = [float(p.split(",")[1]) for p in lines[0].get("points").split()]
    assert ys == sorted(ys)  # loss falls: SVG y grows downward
    assert len(ET.parse(out / "clip.svg").getroot().findall("s:polyline", ns)) == 2


def test_bad_line_is_named(tmp_path, capsys):
    from tools.plot_run import main

    bad = tmp_path / "m.jsonl"
    bad.write_text('{"step": 1, "loss": 1}\n{oops\n')
    assert main([str(bad), "--out", str(tmp_path / "o"), "--metric", "loss"]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
