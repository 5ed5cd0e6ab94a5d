"""Open one analyst's session together with the service it runs on (a door with one session).

The command line (``dpsql query``, ``explain``, ``shell``, ``plot``) loads a policy, checks
the analyst it was told to act as, starts the service over the policy's data and ledger, and
runs its statements on one session; closing the session closes the service. The wire server
and the DB-API share one service between many sessions and open them with
:class:`~dpsql.service.session.Session` directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpsql.errors import check_analyst
from dpsql.pipeline import Service
from dpsql.policy import Policy, load_policy
from dpsql.service.session import Session


def open_session(
    policy: str | Path | Mapping[str, Any] | Policy,
    database: str = ":memory:",
    *,
    analyst: str = "default",
    dialect: str = "duckdb",
    where: str = "--analyst",
    **service_options: Any,
) -> Session:
    """``analyst``'s session over a new service for ``policy`` (its ledger: the policy's
    ``[privacy] ledger`` file, or memory for a policy without a file), owned by the session.

    The analyst is checked against the policy's ``[privacy] analysts`` list before any data is
    opened (``where`` names the option that chose it, for the refusal's hint).
    """
    loaded = policy if isinstance(policy, Policy) else load_policy(policy)
    check_analyst(loaded.analysts, analyst, where)
    service = Service(loaded, database, **service_options)
    try:
        return Session(service, analyst, dialect=dialect, owns_service=True)
    except BaseException:
        service.close()
        raise
