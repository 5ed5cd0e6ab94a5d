"""Running a DP table function statement (``SELECT ... FROM dp_rule_list(...)``, the
regressions): each learner's runner releases through the release transaction and
dpsql.service.table_results; this picks the runner. The learners are imported when a call
uses them (they load numpy-heavy code that other statements never need).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpsql.engine.api import QueryHandle
    from dpsql.frontend.statements import RuleListCall
    from dpsql.service.protocol import Service
    from dpsql.service.results import Result
    from dpsql.service.settings import Settings


def run_table_function(
    service: Service,
    call: RuleListCall,
    settings: Settings,
    analyst: str,
    handle: QueryHandle | None,
) -> Result:
    """Run ``call`` for ``analyst``: dp_rule_list or a regression."""
    if call.function != "dp_rule_list":
        from dpsql.models.regression_function import run_regression

        return run_regression(service, call, settings, analyst, handle)
    from dpsql.rulelist.sql_run import run_rule_list

    return run_rule_list(service, call, settings, analyst, handle)
