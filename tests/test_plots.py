"""``dpsql plot``: the data (error against ε from the plan alone; spent ε from the ledger's log)
tested on their own, then the drawings (PNG/SVG files, skipped without matplotlib)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import dpsql
from dpsql.cli import main
from dpsql.dbapi import connect_service
from dpsql.pipeline import Settings
from dpsql.plots import budget_timeline, draw_budget, draw_error, error_curves

ROOT = Path(__file__).resolve().parents[1]
QUERY = (
    "SELECT department, COUNT(*) AS n, SUM(cost) AS s, AVG(cost) AS a FROM visits "
    "GROUP BY department"
)


@pytest.fixture
def policy(tmp_path) -> Path:
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(ROOT / "fixtures" / name, tmp_path / name)
    return tmp_path / "visits.toml"


@pytest.fixture
def service(policy):
    service = dpsql.Service(policy)
    yield service
    service.close()


def test_error_curves_come_from_the_plan_and_spend_nothing(service, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("plot error must not run the query")

    monkeypatch.setattr(service.engine, "execute", no_engine)
    settings = Settings.from_policy(service.policy)
    curves = error_curves(service, QUERY, settings, "alice")
    assert curves.session_epsilon == 1.0 and len(curves.epsilons) == 31
    assert curves.epsilons[15] == pytest.approx(1.0)
    assert curves.epsilons[0] == pytest.approx(10**-1.5) and curves.epsilons[-1] > 30
    labels = [s.label for s in curves.series]
    assert labels == ["COUNT(*)", "SUM(cost)", "AVG(cost): noise in its sum",
                      "AVG(cost): noise in its count of values"]  # fmt: skip
    # The COUNT curve is its plan's exact half-width at every epsilon.
    from dataclasses import replace

    from dpsql.frontend.bind import parse_statement

    bound = parse_statement(QUERY, service.policy)
    for eps, half in zip(curves.epsilons[::10], curves.series[0].halfwidths[::10], strict=True):
        plan = service.plan(bound, replace(settings, epsilon=eps))
        m = plan.measure(plan.outputs[0].measures[0])
        assert half == m.mechanism.interval_halfwidth(0.95) * m.unit
    for s in curves.series:  # noise falls like 1/epsilon (discrete, so nearly)
        assert all(a >= b for a, b in zip(s.halfwidths, s.halfwidths[1:], strict=False))
        ratio = s.halfwidths[5] / s.halfwidths[25]
        assert ratio == pytest.approx(100, rel=0.05)
    assert service.ledger.spent("alice", service.policy.dataset).epsilon == 0


def test_error_curves_with_a_group_size_and_a_threshold(service):
    settings = Settings.from_policy(service.policy)
    settings.confidence = 0.5
    settings.partition_selection = "threshold"  # the curve of the τ-threshold's unit count
    curves = error_curves(
        service,
        "SELECT diagnosis, AVG(cost) AS a FROM visits GROUP BY diagnosis",
        settings,
        epsilons=[0.5, 1.0, 2.0],
        rows_per_group=1000,
    )
    (avg, units) = curves.series
    assert avg.label == "AVG(cost) at 1000 rows per group"
    assert units.label.startswith("GROUP BY diagnosis: its unit count")
    assert curves.epsilons == (0.5, 1.0, 2.0) and curves.confidence == 0.5
    assert avg.halfwidths[0] > avg.halfwidths[1] > avg.halfwidths[2] > 0


def test_error_curves_refuse_what_is_not_a_query(service):
    settings = Settings.from_policy(service.policy)
    with pytest.raises(dpsql.ProgrammingError, match="aggregate SELECT"):
        error_curves(service, "SHOW budget", settings)
    with pytest.raises(dpsql.PrivacyError):
        error_curves(service, "SELECT * FROM visits", settings)


def test_budget_timeline_follows_the_log(policy, service):
    for analyst, eps in (("alice", 0.5), ("bob", 2.0), ("alice", 0.25)):
        with connect_service(service, analyst) as conn:
            cur = conn.cursor()
            cur.execute(f"SET epsilon = {eps}")
            cur.execute(f"SELECT COUNT(*) FROM visits WHERE age > {int(eps * 100)}")
    service.ledger.reset("alice", service.policy.dataset)
    with connect_service(service, "alice") as conn:
        conn.cursor().execute("SELECT COUNT(*) FROM visits")
    timeline = budget_timeline(service.policy, service.ledger)
    assert timeline.analysts == ("alice", "bob") and timeline.budgets == (10.0, 10.0)
    assert timeline.spent == ((0.5, 0.75, 0.0, 1.0), (2.0,))
    assert all(a <= b for a, b in zip(timeline.times[0], timeline.times[0][1:], strict=False))
    (only,) = budget_timeline(service.policy, service.ledger, "bob").spent
    assert only == (2.0,)


def test_drawings_are_png_and_svg_files(policy, service, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (dpsql[plot])")
    settings = Settings.from_policy(service.policy)
    curves = error_curves(service, QUERY, settings)
    png = draw_error(curves, tmp_path / "error.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = draw_error(curves, tmp_path / "error.svg")
    text = svg.read_text()
    assert "<svg" in text and "session" in text
    with connect_service(service, "alice") as conn:
        conn.cursor().execute("SELECT COUNT(*) FROM visits")
    timeline = budget_timeline(service.policy, service.ledger)
    assert draw_budget(timeline, tmp_path / "budget.svg").stat().st_size > 1000
    with pytest.raises(dpsql.InterfaceError, match="PNG and SVG"):
        draw_error(curves, tmp_path / "error.pdf")


def test_plot_commands(policy, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (dpsql[plot])")
    out = tmp_path / "e.png"
    code = main(["plot", "error", "--policy", str(policy), QUERY, "-o", str(out)])
    assert code == 0 and out.exists() and "nothing spent" in capsys.readouterr().out
    main(["query", "--policy", str(policy), "SELECT COUNT(*) FROM visits"])
    code = main(["plot", "budget", "--policy", str(policy), "-o", str(tmp_path / "b.png")])
    assert code == 0 and (tmp_path / "b.png").exists()
    assert "(1 event in the log)" in capsys.readouterr().out
    code = main(["plot", "budget", "--policy", str(policy), "-o", str(tmp_path / "b.gif")])
    assert code == 1 and "PNG and SVG only" in capsys.readouterr().err
