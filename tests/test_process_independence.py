"""What dpsql releases does not depend on the process: the same statement, secret and noise
seed give the same answer key, values and intervals under every ``PYTHONHASHSEED`` (another
server worker, a restart). Set iteration order follows the hash seed; anything released from it
must be sorted first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _printed_under_hash_seeds(script: str, seeds: tuple[str, ...]) -> set[str]:
    """What ``script`` prints (the tests folder its argv[1]) in a fresh process per
    ``PYTHONHASHSEED``, as a set: one element when it does not depend on the seed."""
    printed = set()
    for seed in seeds:
        run = subprocess.run(
            [sys.executable, "-c", script, str(Path(__file__).parent)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert run.returncode == 0, run.stderr[-2000:]
        printed.add(run.stdout.strip())
    return printed


_KEY_IN_A_PROCESS = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import dpsql
    from test_canonical_keys import _plan, _star_policy
    from dpsql.plan.canonical import answer_key
    from dpsql.privacy.ledger import MemoryLedger
    service = dpsql.Service(_star_policy(), ledger=MemoryLedger())
    text = ("SELECT d.name, COUNT(v.visit_id) FROM departments d LEFT JOIN visits v "
            "ON v.dept_id = d.id GROUP BY d.name")
    print(answer_key(_plan(service, text)))
    """
)


def test_a_public_groups_key_is_the_same_in_every_process():
    """Public groups' values (the key's domain) were in a set's order, which follows the
    process's hash seed: the same query had another answer key in another process, so a
    second worker planned and charged it again instead of serving the remembered answer."""
    keys = _printed_under_hash_seeds(_KEY_IN_A_PROCESS, ("1", "2", "3"))
    assert len(keys) == 1, keys


_INTERVALS_IN_A_PROCESS = textwrap.dedent(
    """
    import secrets, sys
    sys.path.insert(0, sys.argv[1])
    secrets.randbits = lambda n: 12345  # the fixed secret
    import dpsql
    from conftest import declared_clips, fixture_policy
    from dpsql.privacy.ledger import MemoryLedger
    from dpsql.privacy.samplers import SeededNoise

    policy = declared_clips(fixture_policy(privacy={"budget_epsilon": 1e9, "budget_delta": 0.5}))
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), cache=False)
    conn.service.noise = SeededNoise(7)
    cur = conn.cursor()
    cur.execute(
        "SELECT AVG(p) AS a, SUM(p) AS s, COUNT(p) AS n FROM (SELECT patient_id, visit_date, "
        "LEAST(GREATEST(SUM(cost), 0), 1000) AS p FROM visits GROUP BY patient_id, visit_date) "
        "AS u"
    )
    print(repr(cur.fetchall()), repr(cur.intervals))
    """
)


def test_a_sums_interval_is_the_same_in_every_process():
    """A centred SUM's interval simulates two measures' noise; they were drawn in a set's
    order, so the same released SUM carried another interval in another process (seed 4 here:
    (3,727,693, 3,758,232) against (3,730,078, 3,757,667) under seeds 0-3 and 5)."""
    outputs = _printed_under_hash_seeds(_INTERVALS_IN_A_PROCESS, ("0", "4"))
    assert len(outputs) == 1, outputs
