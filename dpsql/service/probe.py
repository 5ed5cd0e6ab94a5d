"""Column probes: ``<relation> LIMIT 0`` (or ``LIMIT 1``), as BI tools send to learn a
relation's columns. Answered free from the text and the schema: no row, no engine read, no
charge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpsql.access import access_for
from dpsql.frontend.bind import parse_probe
from dpsql.frontend.statements import DIALECT
from dpsql.frontend.typecheck import relation_types, type_query
from dpsql.service.results import Result, type_code

if TYPE_CHECKING:
    from dpsql.service.protocol import Service
    from dpsql.service.settings import Settings

# What a column probe's answer says (dpsql.frontend.bind.parse_probe): its columns, never a row.
PROBE_NOTE = (
    "dpsql never releases rows: this row-level query is answered with its columns only "
    "(aggregate it to see data)"
)


def probe(
    service: Service,
    text: str,
    parameters: Sequence[Any] | None,
    settings: Settings,
    analyst: str,
    models: Any,
) -> Result | None:
    """A column probe of an accepted relation (dpsql.frontend.bind.parse_probe: ``<relation>
    LIMIT 0`` or ``LIMIT 1``), answered free: no row, its columns named and typed from
    the text and the schema (the empty shadow tables), no engine read, no charge. None:
    not a probe. A probe of a relation that would be refused is refused the same way.
    ``models``: the analyst's stored models the text may use (dp_predict)."""
    found = parse_probe(
        text,
        service.policy,
        parameters,
        models,
        access_for(service.policy, analyst),
        settings.dialect,
    )
    if found is None:
        return None
    type_query(found.query, service.shadow, analyst)  # its WHERE binds and is BOOLEAN
    columns = relation_types(service.shadow, found.relation.sql(dialect=DIALECT))
    return Result([(name, type_code(t)) for name, t in columns], [], notes=[PROBE_NOTE])
