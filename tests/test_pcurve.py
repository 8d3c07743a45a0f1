"""train.pcurve: both fits recover the line they were drawn from and invert it to the positions a target p
needs; the CLI reads train.heldout's rows and refuses what cannot make a curve."""

import json
import math

import numpy as np
import pytest

from train import pcurve


def _doc(n, p, run="a"):
    return dict(rows=[dict(run=run, step=0, train_positions=0, agreement=0.0)] +
                [dict(run=run, step=i + 1, train_positions=int(x), agreement=float(y)) for i, (x, y) in enumerate(zip(n, p))])


def test_each_form_recovers_its_own_line_and_inverts_it():
    n = np.asarray([1e4, 3e4, 1e5, 3e5])
    p_log = 0.05 + 0.04 * np.log(n)  # log-linear in p
    p_pow = -np.expm1(-0.02 - 0.03 * np.log(n))  # a power law in 1 - p
    for form, p in (("log-linear in p", p_log), ("power law in 1 - p", p_pow)):
        line = pcurve.fit(n, p)[form]
        assert line["rmse"] < 1e-9
        at = pcurve.positions_for(line, form, 0.71)
        want = math.exp((0.71 - 0.05) / 0.04) if form == "log-linear in p" else math.exp((-math.log(0.29) - 0.02) / 0.03)
        assert at == pytest.approx(want, rel=1e-6)
    # the power law needs more positions than the log-linear fit from the same log-linear points
    fits = pcurve.fit(n, p_log)
    assert pcurve.positions_for(fits["power law in 1 - p"], "power law in 1 - p", 0.71) > \
        pcurve.positions_for(fits["log-linear in p"], "log-linear in p", 0.71)
    # a curve that falls never reaches the target
    assert pcurve.positions_for(pcurve.fit(n, p_log[::-1])["log-linear in p"], "log-linear in p", 0.71) == math.inf


def test_cli_writes_the_fits_and_refuses_a_curve_of_one_point(tmp_path, capsys):
    n = [1e4, 2e4, 3e4, 4e4]
    (tmp_path / "heldout.json").write_text(json.dumps(_doc(n, [0.10, 0.13, 0.15, 0.16])))
    assert pcurve.main([str(tmp_path / "heldout.json"), "--runs", "a"]) == 0
    got = json.loads((tmp_path / "pcurve.json").read_text())
    assert got["points"]["positions"] == n and set(got["fits"]) == set(pcurve.FORMS)
    assert (tmp_path / "pcurve.png").is_file() and "accelerator hours" in (tmp_path / "pcurve.md").read_text()
    (tmp_path / "one.json").write_text(json.dumps(_doc([1e4], [0.1])))
    assert pcurve.main([str(tmp_path / "one.json")]) == 2
    assert "two or more training positions" in capsys.readouterr().err
    assert pcurve.main([str(tmp_path / "heldout.json"), "--runs", "b"]) == 2
    assert "no rows for run(s) ['b']" in capsys.readouterr().err
    # a point from elsewhere is shown with each fit's prediction there, not fitted
    assert pcurve.main([str(tmp_path / "heldout.json"), "--mark", "1e6:0.3:other run"]) == 0
    mark = json.loads((tmp_path / "pcurve.json").read_text())["marks"][0]
    assert (mark["label"], mark["positions"], mark["p"]) == ("other run", 1e6, 0.3)
    assert mark["log-linear in p"] == pytest.approx(pcurve.predict(got["fits"]["log-linear in p"], "log-linear in p", 1e6))
    assert json.loads((tmp_path / "pcurve.json").read_text())["fits"] == got["fits"]
    assert pcurve.main([str(tmp_path / "heldout.json"), "--mark", "1e6"]) == 2
    assert "POSITIONS:P:LABEL" in capsys.readouterr().err
