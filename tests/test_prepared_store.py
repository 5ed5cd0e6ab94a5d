"""The prepared store (dpsql.engine.prepared) and the plans over it (dpsql.lower.prepared_plan).

The store may only make plans cheaper: for the same secret, every exact measure of the
store-backed plan equals the plan without a store, over many queries, groupings, filters, R/G
values and NULLs, on the fixture and on generated data where bounds bind for about half the
units. A store is keyed by the data version: another version rebuilds it and a stale one is
never read.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import duckdb
import pytest
from conftest import fixture_policy, table_policy, write_csv

from dpsql.dbapi import Service
from dpsql.engine import prepared
from dpsql.frontend.bind import parse_statement
from dpsql.lower import prepared_plan
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Settings
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger

SECRETS = (0, 4242, 2**61 + 12345, 2**62 - 1)

FIXTURE_QUERIES = [
    "SELECT department, COUNT(*), SUM(cost), AVG(cost) FROM visits GROUP BY department",
    "SELECT COUNT(*), SUM(cost), AVG(cost), VARIANCE(age), STDDEV(cost) FROM visits",
    "SELECT smoker, FLOOR(age / 10) * 10 AS decade, COUNT(*), AVG(cost) FROM visits "
    "WHERE visit_date >= DATE '2024-03-01' GROUP BY smoker, decade",
    "SELECT department, smoker, COUNT(*), SUM(age) FROM visits GROUP BY 1, 2",
    "SELECT department, COUNT(*) FROM visits WHERE cost > 1000 GROUP BY department",
    "SELECT readmitted, AVG(age), COUNT(cost) FROM visits WHERE department IN "
    "('oncology', 'neurology') GROUP BY readmitted",
    "SELECT COUNT(*) FROM visits WHERE smoker",
    "SELECT department, STDDEV(cost) FROM visits WHERE age BETWEEN 20 AND 60 GROUP BY 1",
    "SELECT SUM(cost * 2) FROM visits",
    "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",  # thresholded: no store plan
]


def _with_store(policy, mode: str = "memory", **extra):
    policy = policy if not isinstance(policy, dict) else load_policy(policy)
    engine = dataclasses.replace(policy.engine, prepared=mode, **extra)
    return dataclasses.replace(policy, engine=engine)


def _service(policy, database: str = ":memory:") -> Service:
    return Service(policy, database, ledger=MemoryLedger(), cache=False)


def _norm(rows, nk: int) -> list[tuple]:
    return sorted(
        (tuple(int(v or 0) if i >= nk else v for i, v in enumerate(r)) for r in rows),
        key=repr,
    )


def _compare(svc: Service, queries: list[str]) -> int:
    """Old plan vs store plan, same secret, exact measures; returns how many used the store."""
    settings = Settings.from_policy(svc.policy)
    settings.bias_estimate = "off"  # store plans of the answer's measures (bias: test_bias.py)
    settings.delta = 1e-6
    con = svc.engine._con
    used = 0
    for q in queries:
        plan = svc.plan(parse_statement(q, svc.policy), settings)
        old = compile_plan(plan, 0, store=False)
        new = compile_plan(plan, 0)
        used += new.sql != old.sql
        for secret in SECRETS:
            a = con.execute(old.with_secret(secret).render("duckdb")).fetchall()
            b = con.execute(new.with_secret(secret).render("duckdb")).fetchall()
            nk = len(plan.keys)
            assert _norm(a, nk) == _norm(b, nk), (q, secret)
    return used


@pytest.fixture
def unrouted(monkeypatch):
    """The store's two-phase plan for every shape, as before store_tree left the shapes it does
    not speed up to the plan without a store (test_store_routing_by_shape): the tests taking
    it check that plan exact, and the store's life cycle, on every query."""
    monkeypatch.setattr(prepared_plan, "two_phase_pays", lambda plan: True)


def test_fixture_store_plans_are_exact(unrouted):
    svc = _service(_with_store(fixture_policy()))
    try:
        assert svc.engine.stores and svc.engine.stores[0].hash_mix is not None
        used = _compare(svc, FIXTURE_QUERIES)
        assert used == len(FIXTURE_QUERIES) - 1  # all but the thresholded one
    finally:
        svc.close()


# -- generated data: bounds bind for about half the units ----------------------------------

DEPTS = ["a", "b", "c", "d", "e"]
GEN_COLUMNS = {
    "uid": {"type": "int", "nullable": True},  # a few rows without a unit: never used
    "dept": {"type": "text", "values": DEPTS},  # nullable: NULL is a released bin
    "age": {"type": "int", "lower": 0, "upper": 90},
    "score": {"type": "float", "lower": -10.0, "upper": 10.0, "granularity": 0.01},
    "amount": {"type": "float", "lower": 0.0, "upper": 100.0, "granularity": 0.5},
    "flag": {"type": "bool"},
    "day": {"type": "date", "nullable": False},
}


def _gen_rows(seed: int = 11) -> list[tuple]:
    rnd = random.Random(seed)
    rows = []
    for uid in range(1, 301):
        heavy = uid % 2 == 0  # half the units far over R and G
        home = rnd.choice(DEPTS)
        for _ in range(rnd.randint(8, 20) if heavy else rnd.randint(1, 3)):
            rows.append(
                (
                    None if rnd.random() < 0.01 else uid,
                    None
                    if rnd.random() < 0.08
                    else (home if rnd.random() < 0.6 else rnd.choice(DEPTS)),
                    None if rnd.random() < 0.05 else rnd.randint(-5, 99),
                    None if rnd.random() < 0.1 else round(rnd.uniform(-12, 12), 2),
                    None if rnd.random() < 0.1 else round(rnd.uniform(-1, 120), 3),
                    None if rnd.random() < 0.05 else rnd.random() < 0.4,
                    f"2024-{rnd.randint(1, 12):02d}-{rnd.randint(1, 28):02d}",
                )
            )
    return rows


GEN_QUERIES = [
    "SELECT dept, COUNT(*), SUM(score), AVG(score) FROM t GROUP BY dept",
    "SELECT COUNT(*), SUM(amount), AVG(score), VARIANCE(score) FROM t",
    "SELECT flag, FLOOR(age / 10) * 10 AS decade, COUNT(*), AVG(amount) FROM t "
    "WHERE day >= DATE '2024-03-01' GROUP BY flag, decade",
    "SELECT dept, flag, COUNT(*), SUM(age), STDDEV(amount) FROM t GROUP BY dept, flag",
    "SELECT dept, COUNT(score), SUM(amount) FROM t WHERE score > 0 GROUP BY dept",
    "SELECT flag, COUNT(*) FROM t WHERE dept IN ('a', 'b') OR dept IS NULL GROUP BY flag",
    "SELECT COUNT(*), COUNT(age) FROM t WHERE age IS NULL OR age > 50",
    "SELECT dept, SUM(score * amount) FROM t GROUP BY dept",
    "SELECT dept, AVG(age) FROM t WHERE amount BETWEEN 10 AND 60 AND NOT flag GROUP BY dept",
    "SELECT SUM(score) FROM t WHERE day < DATE '2024-02-01'",
]


@pytest.fixture(scope="module")
def gen_csv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "t.csv"
    return write_csv(path, list(GEN_COLUMNS), _gen_rows())


@pytest.mark.parametrize("bounding", ["scale", "sample"])
@pytest.mark.parametrize(("R", "G"), [(1, 1), (2, 3), (5, 2), (10, 6)])
def test_generated_store_plans_are_exact(gen_csv, R, G, bounding, unrouted):
    policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=R, groups=G)
    policy["tables"]["t"]["bounding"] = bounding
    svc = _service(_with_store(policy))
    try:
        assert _compare(svc, GEN_QUERIES) == len(GEN_QUERIES)
    finally:
        svc.close()


def test_generated_row_level_store_plans_are_exact(gen_csv):
    svc = _service(_with_store(table_policy(gen_csv, GEN_COLUMNS)))
    try:
        assert _compare(svc, GEN_QUERIES) == len(GEN_QUERIES)
    finally:
        svc.close()


def test_half_the_units_are_bounded(gen_csv):
    """The generated data is the case the store is for: some rows go direct, some are bounded
    (so both phases run in the tests above)."""
    policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=5, groups=2)
    svc = _service(_with_store(policy))
    try:
        con = svc.engine._con
        safe, unsafe = con.execute(
            "SELECT count(*) FILTER (WHERE __dp_un <= 5), count(*) FILTER (WHERE __dp_un > 5) "
            "FROM __dp_store_t WHERE uid IS NOT NULL"
        ).fetchone()
        assert safe > 100 and unsafe > 1000
    finally:
        svc.close()


def test_hash_mix_reproduces_keyed_hash(gen_csv):
    """XOR(stored mix, HASH(s)) is DuckDB's HASH(columns..., s), bit for bit, on every row."""
    svc = _service(_with_store(table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=2)))
    try:
        cols = ", ".join(f'"{c}"' for c in GEN_COLUMNS)
        for s in SECRETS:
            row = svc.engine._con.execute(
                f"SELECT bool_and(HASH({cols}, {s}) = XOR(__dp_h, HASH({s}))), count(*) "
                "FROM __dp_store_t"
            ).fetchone()
            assert row[0] is True and row[1] > 1000
    finally:
        svc.close()


# -- disk stores: versions ----------------------------------------------------------------


def _disk_policy(csv_path: Path, store_dir: Path, version: str):
    policy = table_policy(csv_path, GEN_COLUMNS, unit="uid", rows=3, groups=2)
    policy["tables"]["t"]["version"] = version
    return _with_store(policy, "disk", prepared_dir=str(store_dir))


def test_disk_store_reused_rebuilt_and_never_stale(tmp_path, gen_csv, unrouted):
    store_dir = tmp_path / "store"
    first = _service(_disk_policy(gen_csv, store_dir, "v1"))
    info1 = first.engine.stores[0]
    assert not info1.reused and Path(info1.path).is_file()
    first.close()
    assert prepared.STORES == {} or ("t", "v1") not in prepared.STORES  # closed: unregistered

    again = _service(_disk_policy(gen_csv, store_dir, "v1"))
    assert again.engine.stores[0].reused and again.engine.stores[0].path == info1.path
    settings = Settings.from_policy(again.policy)
    settings.bias_estimate = "off"  # store plans of the answer's measures (bias: test_bias.py)
    plan_v1 = again.plan(parse_statement(GEN_QUERIES[0], again.policy), settings)
    assert "__dp_p_t" in compile_plan(plan_v1, 1).sql
    assert _compare(again, GEN_QUERIES[:3]) == 3
    again.close()

    # The data version changes: a new store is built, the old file removed, and a plan made
    # for the old version finds no store (compiles to the plain plan).
    changed = _service(_disk_policy(gen_csv, store_dir, "v2"))
    info2 = changed.engine.stores[0]
    assert not info2.reused and info2.path != info1.path
    assert not Path(info1.path).exists()
    assert prepared.lookup(plan_v1.query.table, "v1") is None
    assert compile_plan(plan_v1, 1).sql == compile_plan(plan_v1, 1, store=False).sql
    changed.close()


def test_tampered_store_is_rebuilt(tmp_path, gen_csv):
    """A file whose metadata does not carry this very key is never read, but rebuilt."""
    store_dir = tmp_path / "store"
    svc = _service(_disk_policy(gen_csv, store_dir, "v1"))
    path = Path(svc.engine.stores[0].path)
    svc.close()
    con = duckdb.connect(str(path))
    con.execute('UPDATE meta SET info = \'{"key": "other", "hashed": true}\'')
    con.execute("DELETE FROM store WHERE uid = 2")
    con.close()
    svc = _service(_disk_policy(gen_csv, store_dir, "v1"))
    try:
        assert not svc.engine.stores[0].reused
        assert _compare(svc, GEN_QUERIES[:2]) == 2
    finally:
        svc.close()


def test_no_disk_store_without_a_version(tmp_path):
    """Without a data version nothing tells a later process that the data changed."""
    rows = [(u, "a", 1, 1.0, 1.0, True, "2024-01-01") for u in range(5)]
    path = write_csv(tmp_path / "t.csv", list(GEN_COLUMNS), rows)
    policy = table_policy(path, GEN_COLUMNS, unit="uid", rows=3, groups=2)
    svc = _service(_with_store(policy, "disk", prepared_dir=str(tmp_path / "s")))
    try:
        # a CSV's version is its digest, so it gets a store; an attached table would not
        assert svc.engine.stores
    finally:
        svc.close()


def test_store_plan_choice_depends_on_policy_only(gen_csv, tmp_path):
    """Two datasets with the same policy compile to the same text: no statistic shapes it."""
    other = write_csv(tmp_path / "t.csv", list(GEN_COLUMNS), _gen_rows(seed=99)[:50])
    texts = []
    for path in (gen_csv, other):
        svc = _service(_with_store(table_policy(path, GEN_COLUMNS, unit="uid", rows=3, groups=2)))
        settings = Settings.from_policy(svc.policy)
        settings.bias_estimate = "off"  # store plans of the answer's measures (bias: test_bias.py)
        texts.append(
            [
                compile_plan(svc.plan(parse_statement(q, svc.policy), settings), 5).sql
                for q in GEN_QUERIES
            ]
        )
        svc.close()
    assert texts[0] == texts[1]


def test_policy_rejects_unknown_mode():
    from dpsql.errors import PolicyError

    policy = fixture_policy()
    policy["engine"] = {"prepared": "sometimes"}
    with pytest.raises(PolicyError, match="prepared"):
        load_policy(policy)


def test_all_secrets_and_queries_cover_two_phases():
    """Sanity of the suite itself: the secrets include edge values of the 62-bit range."""
    assert any(s > 2**61 for s in SECRETS) and 0 in SECRETS
    assert len(list(itertools.product(GEN_QUERIES, SECRETS))) >= 40


def prepare_policy(directory: Path, source: Path, engine: str = "") -> Path:
    """A policy file for ``dpsql prepare`` over the generated CSV (``engine``: its section)."""
    policy = directory / "p.toml"
    policy.write_text(
        f'{engine}[privacy]\nepsilon = 1.0\n\n[tables.t]\nsource = "{source}"\n'
        'privacy_unit = "uid"\nmax_rows_per_unit = 2\n\n[tables.t.columns.uid]\ntype = "int"\n\n'
        '[tables.t.columns.dept]\ntype = "text"\nvalues = ["a", "b"]\n'
    )
    return policy


def test_dpsql_prepare_builds_then_reuses(tmp_path, gen_csv, capsys):
    from dpsql.cli import main

    policy = prepare_policy(tmp_path, gen_csv)
    assert main(["prepare", "--policy", str(policy)]) == 0
    first = capsys.readouterr()
    assert "\tbuilt\t" in first.out and "building the prepared store" in first.err
    assert main(["prepare", "--policy", str(policy)]) == 0
    assert "\treused\t" in capsys.readouterr().out
    assert list((tmp_path / "dpsql-store").glob("t-*.duckdb"))


def test_joins_and_unit_path_tables_keep_the_plain_plan():
    """A unit_path table's unit is not among its own columns (it is read through its path), and
    a join reads its joined source: no store for them; the star policy still connects with the
    store on, and their exact measures equal the store-off ones for the same secret."""
    from test_private_joins import star_policy

    from dpsql.lower.compile import compile_plan

    queries = [
        "SELECT drug, COUNT(*) FROM prescriptions GROUP BY drug",
        "SELECT p.sex, COUNT(*), SUM(v.cost) FROM visits v JOIN patients p "
        "ON v.patient_id = p.patient_id GROUP BY p.sex",
    ]
    on, off = (
        _service(_with_store(star_policy(rows=3, groups=2))),
        _service(star_policy(rows=3, groups=2)),
    )
    try:
        assert {i.table for i in on.engine.stores} == {"visits", "patients"}
        settings = Settings.from_policy(on.policy)
        settings.bias_estimate = "off"  # store plans of the answer's measures (bias: test_bias.py)
        for sql in queries:
            plans = [s.plan(parse_statement(sql, s.policy), settings) for s in (on, off)]
            compiled = [compile_plan(p, 11) for p in plans]
            assert "__dp_store" not in compiled[0].render()
            got, want = (s.engine.execute(q) for s, q in zip((on, off), compiled, strict=True))
            assert sorted(zip(got.key_rows, *got.measures, strict=True)) == sorted(
                zip(want.key_rows, *want.measures, strict=True)
            )
    finally:
        on.close()
        off.close()


def test_unfiltered_plans_read_the_stored_pair_partials(gen_csv):
    """No WHERE, no key or one small-domain key: the pairs come from the stored partials (no
    row is read; exactness is the generated test above); a WHERE, two keys, an expression key or
    sampling read the rows."""
    policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=2, groups=2)
    svc = _service(_with_store(policy))
    sampled_policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=2, groups=2)
    sampled_policy["tables"]["t"]["bounding"] = "sample"
    sampled = _service(_with_store(sampled_policy))
    try:
        settings = Settings.from_policy(svc.policy)
        settings.bias_estimate = "off"  # store plans of the answer's measures (bias: test_bias.py)

        def sql_of(service, q):
            return compile_plan(service.plan(parse_statement(q, service.policy), settings), 1).sql

        partial = {
            "SELECT dept, COUNT(*), SUM(score), AVG(score) FROM t GROUP BY dept": "_pairs",
            "SELECT COUNT(*), SUM(amount), VARIANCE(score) FROM t": "_units",
            "SELECT flag, COUNT(*) FROM t GROUP BY flag": "_pairs",
        }
        for q, relation in partial.items():
            text = sql_of(svc, q)
            assert f'"__dp_store_t{relation}' in text and '"__dp_store_t"' not in text, q
        rows = [
            "SELECT dept, SUM(score) FROM t WHERE age > 3 GROUP BY dept",
            "SELECT dept, flag, SUM(score) FROM t GROUP BY dept, flag",
            "SELECT FLOOR(age / 10), SUM(score) FROM t GROUP BY 1",
            "SELECT dept, SUM(score * 2) FROM t GROUP BY dept",  # a computed value
        ]
        for q in rows:
            assert "__dp_store_t_" not in sql_of(svc, q), q
        # sampling keeps rows: only its counts-only plans may read the partials
        assert "__dp_store_t_" not in sql_of(sampled, "SELECT SUM(score) FROM t")
        assert "__dp_store_t_units" in sql_of(sampled, "SELECT COUNT(*) FROM t")
    finally:
        svc.close()
        sampled.close()


def test_a_service_without_a_store_never_compiles_against_anothers(gen_csv, unrouted):
    """Two services in one process over one table and version, one with a memory store: each
    compiles against its own engine's store (or none). Before plans named their store, the
    one without read the other's registered store and failed on a relation it lacks."""
    policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=2, groups=2)
    plain = _service(load_policy(policy))
    stored = _service(_with_store(policy))
    try:
        settings = Settings.from_policy(plain.policy)
        settings.bias_estimate = "off"  # store plans of the answer's measures (bias: test_bias.py)
        for q in GEN_QUERIES[:3]:
            a = plain.plan(parse_statement(q, plain.policy), settings)
            b = stored.plan(parse_statement(q, stored.policy), settings)
            assert a.store is None and b.store is not None
            sql_a, sql_b = compile_plan(a, 3), compile_plan(b, 3)
            assert "__dp_" + "store" not in sql_a.sql and "__dp_store_t" in sql_b.sql
            rows_a = plain.engine._con.execute(sql_a.render("duckdb")).fetchall()
            rows_b = stored.engine._con.execute(sql_b.render("duckdb")).fetchall()
            nk = len(a.keys)
            assert _norm(rows_a, nk) == _norm(rows_b, nk), q
    finally:
        plain.close()
        stored.close()


def test_store_routing_by_shape(gen_csv):
    """A store plan is never slower than the plan without one (issue 28 item 2): a rescaled or
    counts-only plan whose units may be over G (groups ranked) with rows to read (a WHERE)
    groups every row by unit when every unit is over G, slower over the store's wider rows
    (bench/bench_prepared_sql.py), so it runs the plan without a store; with groups not ranked
    (G at least the key's bins), sampled, or read from the stored partials (no WHERE), the
    store plan runs. The choice is the shape's (same text on other data:
    test_store_plan_choice_depends_on_policy_only) and the answers are equal either way."""
    where = "SELECT dept, COUNT(*), SUM(score) FROM t WHERE age > 3 GROUP BY dept"
    counts = "SELECT dept, COUNT(*) FROM t WHERE age > 3 GROUP BY dept"
    bare = "SELECT dept, COUNT(*), SUM(score) FROM t GROUP BY dept"
    cases = [  # (G, bounding, query, store plan chosen); dept: 5 values and NULL, 6 bins
        (2, "scale", where, False),
        (2, "scale", counts, False),
        (2, "sample", counts, False),  # counts only: one grouped scan, as rescaled
        (2, "scale", bare, True),  # the stored pair partials
        (2, "sample", where, True),  # three scans, each reading fewer rows
        (6, "scale", where, True),  # every row within R goes direct
        (6, "scale", counts, True),
    ]
    for G, bounding, q, chosen in cases:
        policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=3, groups=G)
        policy["tables"]["t"]["bounding"] = bounding
        svc = _service(_with_store(policy))
        try:
            assert _compare(svc, [q]) == int(chosen), (G, bounding, q)
        finally:
            svc.close()


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_a_table_name_that_needs_quoting_keeps_its_store(gen_csv, tmp_path, mode):
    """The store's build and its plans name the store (and a disk store's catalog) by quoted
    identifiers built from the table's name, never text spliced around it: a name with a
    hyphen builds its store and its plans read it, answers equal to the plan without one."""
    policy = table_policy(gen_csv, GEN_COLUMNS, name="visits-2024", unit="uid", rows=3, groups=6)
    policy["tables"]["visits-2024"]["version"] = "v1"
    svc = _service(_with_store(policy, mode, prepared_dir=str(tmp_path / "store")))
    try:
        assert [info.table for info in svc.engine.stores] == ["visits-2024"]
        queries = [
            'SELECT dept, COUNT(*), SUM(score) FROM "visits-2024" GROUP BY dept',  # partials
            'SELECT dept, COUNT(*), SUM(score) FROM "visits-2024" WHERE age > 3 GROUP BY dept',
        ]
        assert _compare(svc, queries) == len(queries)
    finally:
        svc.close()
