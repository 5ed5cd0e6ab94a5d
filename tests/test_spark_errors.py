"""Choosing and configuring the Spark engine, and failing clearly before any data is read.

None of these start a JVM: a missing Java or an unreachable master is caught by dpsql's own
checks before pyspark launches anything, and the policy's [engine] section is validated at
load time. Each failure happens at connect, so nothing can be released or charged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import fixture_policy

import dpsql
from dpsql.engine.spark_engine import check_java, probe_master
from dpsql.errors import OperationalError, PolicyError, ProgrammingError
from dpsql.policy import load_policy

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.spark


def _connect_in_subprocess(env: dict[str, str], policy: dict) -> dict:
    """connect(engine="spark") in a fresh interpreter with ``env``; the error it raised."""
    script = textwrap.dedent(
        """
        import json, sys
        import dpsql
        policy = json.loads(sys.argv[1])
        try:
            dpsql.connect(policy=policy, engine="spark")
        except dpsql.Error as exc:
            print(json.dumps({"type": type(exc).__name__, "sqlstate": exc.sqlstate,
                              "message": exc.message, "hint": exc.hint}))
        else:
            print(json.dumps({"type": None}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(policy)],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _policy(tmp_path: Path) -> dict:
    policy = fixture_policy()
    policy["privacy"]["ledger"] = str(tmp_path / "budget.sqlite")
    return policy


def test_java_home_pointing_nowhere(tmp_path):
    pytest.importorskip("pyspark")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["JAVA_HOME"] = str(tmp_path / "no-jdk-here")
    error = _connect_in_subprocess(env, _policy(tmp_path))
    assert error["type"] == "OperationalError" and error["sqlstate"] == "08001"
    assert "JAVA_HOME" in error["message"] and "Java 17" in error["hint"]
    assert not (tmp_path / "budget.sqlite").exists()  # nothing was opened, let alone charged


def test_no_java_on_path(tmp_path):
    pytest.importorskip("pyspark")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # an empty directory: no java anywhere
    error = _connect_in_subprocess(env, _policy(tmp_path))
    assert error["type"] == "OperationalError"
    assert "no java is on PATH" in error["message"] and "apt-get install" in error["hint"]


def test_check_java_accepts_this_machine():
    if not (os.environ.get("JAVA_HOME") or __import__("shutil").which("java")):
        pytest.skip("no Java on this machine")
    assert Path(check_java()).name == "java"


def test_unreachable_master_fails_fast_at_connect(tmp_path):
    pytest.importorskip("pyspark")
    policy = _policy(tmp_path)
    policy["engine"] = {"name": "spark", "master": "spark://127.0.0.1:1"}
    with pytest.raises(OperationalError) as err:
        dpsql.connect(policy=policy)
    assert err.value.sqlstate == "08001"
    assert "cannot reach the Spark master 'spark://127.0.0.1:1'" in str(err.value)
    assert "engine.master" in str(err.value)
    assert not (tmp_path / "budget.sqlite").exists()


def test_probe_ignores_local_and_yarn_masters():
    for master in (None, "local[2]", "local[*]", "yarn"):
        probe_master(master)


def test_policy_engine_section():
    policy = fixture_policy()
    policy["engine"] = {"name": "spark", "master": "local[2]", "conf": {"spark.x": 4}}
    engine = load_policy(policy).engine
    assert (engine.name, engine.master, dict(engine.conf)) == ("spark", "local[2]", {"spark.x": 4})
    assert load_policy(fixture_policy()).engine.name == "duckdb"


@pytest.mark.parametrize(
    ("engine", "key"),
    [
        ({"name": "presto"}, "engine.name"),
        ({"master": "local[2]"}, "engine.master"),  # duckdb takes no master
        ({"name": "spark", "conf": {"spark.x": [1, 2]}}, "engine.conf"),
        ({"name": "spark", "threads": 4}, "engine.threads"),
    ],
)
def test_bad_engine_section_is_a_policy_error(engine, key):
    policy = fixture_policy()
    policy["engine"] = engine
    with pytest.raises(PolicyError) as err:
        load_policy(policy)
    assert err.value.construct == key


def test_spark_sources_uri_and_catalog_pass_the_loader():
    policy = fixture_policy()
    policy["engine"] = {"name": "spark"}
    policy["tables"]["visits"]["source"] = "s3a://lake/visits.parquet"
    assert load_policy(policy).tables["visits"].source_path is None
    policy["tables"]["visits"]["source"] = "warehouse.visits"
    assert load_policy(policy).tables["visits"].source_path is None


def test_engine_arguments_are_checked():
    with pytest.raises(ProgrammingError, match="unknown engine"):
        dpsql.connect(policy=fixture_policy(), engine="oracle")
    with pytest.raises(ProgrammingError, match="spark_session"):
        dpsql.connect(policy=fixture_policy(), engine="duckdb", spark_session=object())
    with pytest.raises(ProgrammingError, match="database="):
        dpsql.connect("some.duckdb", policy=fixture_policy(), engine="spark")
