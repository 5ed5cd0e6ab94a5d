"""ModelStore: put/get/list/delete in memory and in the ledger's SQLite file; the SQL path
stores a rule list under a name with its cost and query; `dpsql model` prints JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dpsql
from dpsql.dbapi import connect_service
from dpsql.models.store import ModelStore, StoredModel
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise
from dpsql.privacy.sqlite_ledger import SQLiteLedger

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "visits.toml"


def _model(name="m", analyst="alice", dataset="visits", kind="rule_list") -> StoredModel:
    return StoredModel(
        name,
        kind,
        analyst,
        dataset,
        "visits",
        "2026-01-01T00:00:00+00:00",
        1.0,
        0.0,
        0.0,
        "SELECT 1",
        json.dumps({"x": 1}),
    )


@pytest.mark.parametrize("durable", [False, True])
def test_put_get_list_delete(tmp_path, durable):
    ledger = SQLiteLedger(tmp_path / "l.sqlite") if durable else MemoryLedger()
    store = ModelStore.for_ledger(ledger)
    assert ModelStore.for_ledger(ledger) is store
    assert (store.path is not None) == durable
    store.put(_model("b"))
    store.put(_model("a"))
    store.put(_model("a", analyst="bob"))
    store.put(_model("a", dataset="other"))
    assert store.get("alice", "visits", "a") == _model("a")
    assert store.get("alice", "visits", "zzz") is None
    assert [m.name for m in store.list("alice", "visits")] == ["a", "b"]
    assert len(store.list()) == 4
    replaced = _model("a")
    replaced = StoredModel(**{**replaced.__dict__, "epsilon": 2.0})
    store.put(replaced)  # same name: replaced
    assert store.get("alice", "visits", "a").epsilon == 2.0
    assert store.delete("alice", "visits", "a") and not store.delete("alice", "visits", "a")
    assert store.get("bob", "visits", "a") is not None  # per analyst
    assert "model_json" not in _model().summary()
    with pytest.raises(ValueError):
        store.put(_model(kind="forest"))
    if durable:  # another store on the same file sees the models (the ledger's file)
        again = ModelStore(tmp_path / "l.sqlite")
        assert [m.name for m in again.list("alice", "visits")] == ["b"]
        ledger.close()


def test_dp_rule_list_stores_the_model_with_its_cost_and_query():
    svc = dpsql.Service(FIXTURE, ledger=MemoryLedger(), noise=SeededNoise(3))
    cur = connect_service(svc, "carol").cursor()
    sql = (
        "SELECT * FROM dp_rule_list('visits', label => 'smoker', epsilon => 0.5, "
        "max_length => 3, model => 'smoke1')"
    )
    cur.execute(sql)
    rows = cur.fetchall()
    assert any("stored as model 'smoke1'" in m for _, m in cur.messages)
    stored = ModelStore.for_ledger(svc.ledger).get("carol", svc.policy.dataset, "smoke1")
    assert stored is not None and stored.kind == "rule_list" and stored.table == "visits"
    assert stored.epsilon == pytest.approx(0.5) and stored.delta == 0.0 and stored.query == sql
    payload = json.loads(stored.model_json)
    assert payload["label"] == "smoker" and len(payload["rule_list"]["rules"]) == len(rows)
    assert ModelStore.for_ledger(svc.ledger).get("dave", svc.policy.dataset, "smoke1") is None
    with pytest.raises(dpsql.ProgrammingError, match="invalid model name") as info:
        cur.execute(sql.replace("'smoke1'", "'1 bad; name'"))
    assert info.value.sqlstate == "42602"
    svc.close()


def test_model_cli_lists_shows_and_exports_json(tmp_path, capsys):
    from dpsql.cli import main

    policy = tmp_path / "p.toml"
    text = FIXTURE.read_text().replace(
        'source = "visits.csv"', f'source = "{FIXTURE.parent}/visits.csv"'
    )
    policy.write_text(text.replace("[privacy]", '[privacy]\nledger = "models.sqlite"', 1))
    with dpsql.connect(policy=str(policy), analyst="erin", noise=SeededNoise(1)) as conn:
        conn.cursor().execute(
            "SELECT * FROM dp_rule_list('visits', label => 'smoker', max_length => 2, "
            "model => 'm2')"
        )
    capsys.readouterr()
    assert main(["model", "list", "--policy", str(policy), "--analyst", "erin"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listed] == ["m2"] and listed[0]["epsilon"] == pytest.approx(1.0)
    assert main(["model", "show", "m2", "--policy", str(policy), "--analyst", "erin"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["query"].startswith("SELECT") and "rule_list" in shown["model"]
    assert main(["model", "export", "m2", "--policy", str(policy), "--analyst", "erin"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "rule_list"
    assert main(["model", "show", "m2", "--policy", str(policy), "--analyst", "x"]) == 1
    assert "42704" in capsys.readouterr().err
    assert main(["model", "delete", "m2", "--policy", str(policy), "--analyst", "erin"]) == 0
