"""Drive a running Apache Superset through its REST API against ``dpsql serve`` and report,
per chart, the rows it got, the time to answer and any error; then list the distinct SQL texts
the server logged, as draft BI replay shapes.

Prerequisites (docs/bi_tools.md, "A real Superset run"): Superset running on ``--superset``
with an admin login, and ``python tests/bi_shapes/capture_server.py --port 15433 --log LOG``
(a private copy of the visits fixture, user ``bi``). Then::

    python bench/superset_run.py --log LOG [--superset http://127.0.0.1:8088] [--port 15433]
        [--shapes-out /tmp/superset_draft.toml]

It creates (or reuses: Superset's SQLite metadata keeps table names unique) the database
``dpsql visits`` and the physical dataset ``public.visits``; then four virtual datasets named
by the time (percent of total, cohort in the CTE form, each patient's first month, a row-level
column list), a dashboard, and the charts: daily, weekly and monthly line charts of COUNT(*)
(time grains P1D, P1W, P1M), a table with a percent-of-total metric (Superset's own
``contribution`` post-processing), a table over a virtual dataset computing ``COUNT(*) *
100.0 / SUM(COUNT(*)) OVER ()`` in SQL, two cohort charts and AVG(cost) by decade. Each
chart's data is fetched through ``/api/v1/chart/data`` with ``force`` (no Superset cache), as
the dashboard does. Uses only ``requests`` (run it with any Python that has it, e.g.
Superset's venv).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import requests

COUNT = {"expressionType": "SQL", "sqlExpression": "COUNT(*)", "label": "COUNT(*)"}

PCT_SQL = (
    "SELECT DATE_TRUNC('month', visit_date) AS month, COUNT(*) AS visits,\n"
    "       COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () AS pct_of_total\n"
    "FROM visits GROUP BY 1"
)
COHORT_CTE_SQL = (
    "WITH first AS (SELECT patient_id, MIN(DATE_TRUNC('month', visit_date)) AS m\n"
    "               FROM visits GROUP BY patient_id)\n"
    "SELECT m, COUNT(*) AS patients FROM first GROUP BY m"
)
ROW_LEVEL_SQL = "SELECT department, age / 10 AS decade, cost FROM visits WHERE smoker"
FIRST_MONTH_SQL = (
    "SELECT patient_id, MIN(DATE_TRUNC('month', visit_date)) AS first_month\n"
    "FROM visits GROUP BY patient_id"
)


class Superset:
    """A logged-in REST client (JWT bearer token plus the CSRF token the UI sends)."""

    def __init__(self, base: str, user: str, password: str) -> None:
        self.base = base.rstrip("/")
        self.http = requests.Session()
        login = self.http.post(
            f"{self.base}/api/v1/security/login",
            json={"username": user, "password": password, "provider": "db", "refresh": True},
            timeout=60,
        )
        login.raise_for_status()
        self.http.headers["Authorization"] = f"Bearer {login.json()['access_token']}"
        csrf = self.http.get(f"{self.base}/api/v1/security/csrf_token/", timeout=60)
        csrf.raise_for_status()
        self.http.headers["X-CSRFToken"] = csrf.json()["result"]
        self.http.headers["Referer"] = self.base

    def post(self, path: str, body: dict[str, Any]) -> requests.Response:
        return self.http.post(f"{self.base}{path}", json=body, timeout=600)

    def find(self, kind: str, column: str, value: str) -> int | None:
        """The id of the first ``kind`` (database, dataset) whose ``column`` equals ``value``."""
        query = {"filters": [{"col": column, "opr": "eq", "value": value}]}
        response = self.http.get(
            f"{self.base}/api/v1/{kind}/", params={"q": json.dumps(query)}, timeout=60
        )
        found = response.json().get("result", []) if response.ok else []
        return int(found[0]["id"]) if found else None

    def create(self, path: str, body: dict[str, Any]) -> int:
        response = self.post(path, body)
        if response.status_code >= 300:
            raise RuntimeError(f"POST {path}: HTTP {response.status_code} {response.text[:500]}")
        return int(response.json()["id"])


def time_axis(column: str, grain: str) -> dict[str, Any]:
    return {
        "timeGrain": grain,
        "columnType": "BASE_AXIS",
        "sqlExpression": column,
        "label": column,
        "expressionType": "SQL",
    }


def timeseries_chart(name: str, ds: int, column: str, grain: str) -> dict[str, Any]:
    """An ECharts line chart of COUNT(*) over ``column`` at ``grain``, as Explore builds it."""
    form = {
        "datasource": f"{ds}__table",
        "viz_type": "echarts_timeseries_line",
        "x_axis": column,
        "time_grain_sqla": grain,
        "metrics": [COUNT],
        "groupby": [],
        "adhoc_filters": [],
        "row_limit": 10000,
        "time_range": "No filter",
    }
    query = {
        "columns": [time_axis(column, grain)],
        "metrics": [COUNT],
        "orderby": [[COUNT, False]],
        "filters": [],
        "extras": {"having": "", "where": ""},
        "time_range": "No filter",
        "row_limit": 10000,
        "series_columns": [],
        "series_limit": 0,
        "order_desc": True,
        "post_processing": [
            {
                "operation": "pivot",
                "options": {
                    "index": [column],
                    "columns": [],
                    "aggregates": {"COUNT(*)": {"operator": "mean"}},
                    "drop_missing_columns": False,
                },
            },
            {"operation": "flatten"},
        ],
    }
    return {"name": name, "viz": "echarts_timeseries_line", "ds": ds, "form": form, "query": query}


def table_chart(
    name: str, ds: int, columns: list[Any], metrics: list[Any], **extra: Any
) -> dict[str, Any]:
    """A table chart: aggregate mode when ``metrics`` is given, raw mode otherwise."""
    raw = not metrics
    form = {
        "datasource": f"{ds}__table",
        "viz_type": "table",
        "query_mode": "raw" if raw else "aggregate",
        "groupby": [] if raw else columns,
        "all_columns": columns if raw else [],
        "metrics": metrics,
        "percent_metrics": extra.get("percent_metrics", []),
        "row_limit": 1000,
        "time_range": "No filter",
        "adhoc_filters": [],
    }
    query: dict[str, Any] = {
        "columns": columns,
        # percent metrics are already among the metrics (the table chart dedupes them); raw
        # mode sends no metrics at all (None: no GROUP BY)
        "metrics": metrics or None,
        "orderby": [[metrics[0], False]] if metrics else [],
        "filters": [],
        "extras": {"having": "", "where": ""},
        "time_range": "No filter",
        "row_limit": 1000,
        "order_desc": True,
        "post_processing": extra.get("post_processing", []),
    }
    return {"name": name, "viz": "table", "ds": ds, "form": form, "query": query}


def chart_data(client: Superset, chart: dict[str, Any]) -> dict[str, Any]:
    """POST /api/v1/chart/data for one chart (force: bypass Superset's cache); rows, time, error."""
    body = {
        "datasource": {"id": chart["ds"], "type": "table"},
        "force": True,
        "queries": [chart["query"]],
        "form_data": chart["form"],
        "result_format": "json",
        "result_type": "full",
    }
    start = time.perf_counter()
    response = client.post("/api/v1/chart/data", body)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"chart": chart["name"], "http": response.status_code, "s": seconds}
    try:
        payload = response.json()
    except ValueError:
        out["error"] = response.text[:300]
        return out
    if response.status_code != 200:
        out["error"] = payload.get("message") or payload.get("errors") or payload
        return out
    result = payload["result"][0]
    data = result.get("data") or []
    out["rows"] = len(data)
    out["sql"] = result.get("query", "")
    if result.get("error"):
        out["error"] = result["error"]
    numeric = [
        v
        for row in data
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and "COUNT" in k.upper()
    ]
    out["empty_or_zero"] = sum(1 for v in numeric if v is None or v <= 0)
    out["first"] = data[0] if data else None
    out["last"] = data[-1] if data else None
    return out


def draft_shapes(log: Path, since: float, out: Path) -> int:
    """Write the distinct ``dp``/``probe`` statements logged since ``since`` as draft shapes."""
    seen: dict[str, dict[str, Any]] = {}
    for line in log.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if entry["t"] < since or entry["kind"] in ("tx", "set", "show", "catalog", "noop"):
            continue
        seen.setdefault(entry["sql"], entry)
    lines = [
        "# Draft shapes logged by bench/superset_run.py; review, name and add a reference.",
        'tool = "superset"',
    ]
    for i, (sql, entry) in enumerate(seen.items()):
        outcome = entry.get("error") or f"{entry.get('rows')} rows"
        lines += [
            "",
            "[[shape]]",
            f'name = "captured_{i}"',
            f"# kind {entry['kind']}: {outcome}",
            f"sql = '''{sql}'''",
        ]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--superset", default="http://127.0.0.1:8088")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password", default="admin")
    parser.add_argument("--port", type=int, default=15433, help="dpsql serve's port")
    parser.add_argument("--log", type=Path, help="capture_server.py's statement log")
    parser.add_argument("--shapes-out", type=Path, default=Path("/tmp/superset_draft.toml"))
    args = parser.parse_args()
    since = time.time()
    stamp = time.strftime("%H%M%S")
    client = Superset(args.superset, args.user, args.password)
    uri = f"postgresql+psycopg2://bi:bi-password@127.0.0.1:{args.port}/visits"
    # Superset's SQLite metadata keeps table names unique: reuse the database and the physical
    # dataset of an earlier run (same name, same URI), create them on the first
    db = client.find("database", "database_name", "dpsql visits") or client.create(
        "/api/v1/database/", {"database_name": "dpsql visits", "sqlalchemy_uri": uri}
    )
    physical = client.find("dataset", "table_name", "visits") or client.create(
        "/api/v1/dataset/", {"database": db, "schema": "public", "table_name": "visits"}
    )
    virtual: dict[str, int | str] = {}
    for name, sql in (
        ("pct", PCT_SQL),
        ("cohort", COHORT_CTE_SQL),
        ("first", FIRST_MONTH_SQL),
        ("rows", ROW_LEVEL_SQL),
    ):
        body = {"database": db, "schema": "public", "table_name": f"{name}_{stamp}", "sql": sql}
        response = client.post("/api/v1/dataset/", body)
        if response.status_code >= 300:
            virtual[name] = f"HTTP {response.status_code}: {response.text[:300]}"
        else:
            virtual[name] = int(response.json()["id"])
    print(json.dumps({"database": db, "physical": physical, "virtual": virtual}))
    charts = [
        timeseries_chart("daily visits", physical, "visit_date", "P1D"),
        timeseries_chart("weekly visits", physical, "visit_date", "P1W"),
        timeseries_chart("monthly visits", physical, "visit_date", "P1M"),
        table_chart(
            "percent of total by department (Superset contribution)",
            physical,
            ["department"],
            [COUNT],
            percent_metrics=[COUNT],
            post_processing=[
                {
                    "operation": "contribution",
                    "options": {"columns": ["COUNT(*)"], "rename_columns": ["%COUNT(*)"]},
                }
            ],
        ),
    ]
    if isinstance(virtual["pct"], int):
        charts.append(
            table_chart(
                "percent of total by month (SQL window)",
                virtual["pct"],
                ["month", "visits", "pct_of_total"],
                [],
            )
        )
    if isinstance(virtual["cohort"], int):
        charts.append(table_chart("cohort (CTE dataset)", virtual["cohort"], ["m", "patients"], []))
    if isinstance(virtual["first"], int):
        charts.append(
            timeseries_chart("cohort: first visit month", virtual["first"], "first_month", "P1M")
        )
    if isinstance(virtual["rows"], int):
        charts.append(
            table_chart(
                "AVG(cost) by decade (row-level dataset)",
                virtual["rows"],
                ["decade"],
                [{"expressionType": "SQL", "sqlExpression": "AVG(cost)", "label": "AVG(cost)"}],
            )
        )
    dash = client.create(
        "/api/v1/dashboard/", {"dashboard_title": f"dpsql visits {stamp}", "published": True}
    )
    results = []
    for chart in charts:
        chart_id = client.create(
            "/api/v1/chart/",
            {
                "slice_name": chart["name"],
                "viz_type": chart["viz"],
                "datasource_id": chart["ds"],
                "datasource_type": "table",
                "params": json.dumps(chart["form"]),
                "query_context": json.dumps(
                    {
                        "datasource": {"id": chart["ds"], "type": "table"},
                        "queries": [chart["query"]],
                        "form_data": chart["form"],
                        "result_format": "json",
                        "result_type": "full",
                    }
                ),
                "dashboards": [dash],
            },
        )
        result = chart_data(client, chart)
        result["id"] = chart_id
        results.append(result)
        shown = {k: v for k, v in result.items() if k != "sql"}
        print(json.dumps(shown, default=str))
    listed = client.http.get(f"{client.base}/api/v1/dashboard/{dash}/charts", timeout=60).json()
    print(json.dumps({"dashboard": dash, "charts": len(listed.get("result", []))}))
    if args.log:
        time.sleep(1)
        n = draft_shapes(args.log, since, args.shapes_out)
        print(f"{n} distinct dp/probe statements written to {args.shapes_out}")


if __name__ == "__main__":
    main()
