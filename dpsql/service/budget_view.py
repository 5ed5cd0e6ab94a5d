"""``SHOW budget`` (and ``SHOW budget WIDE``): an analyst's own spent and remaining budget.

A read of the analyst's own ledger rows: it costs nothing and names nobody else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpsql.service.results import Result

if TYPE_CHECKING:
    from dpsql.service.protocol import Service
    from dpsql.service.settings import Settings

# SHOW budget: one ε view, one ρ (Service.show_budget); SHOW budget WIDE adds the rest.
BUDGET_SHOWS = ("budget", "budget_wide")
BUDGET_COLUMNS = [
    ("analyst", "VARCHAR"),
    ("spent_epsilon", "DOUBLE"),
    ("budget_epsilon", "DOUBLE"),
    ("remaining_epsilon", "DOUBLE"),
    ("spent_delta", "DOUBLE"),
    ("budget_delta", "DOUBLE"),
    ("remaining_delta", "DOUBLE"),
    ("spent_rho", "DOUBLE"),
    ("queries_left", "BIGINT"),
    ("binding_limit", "VARCHAR"),
    ("period", "VARCHAR"),
]
BUDGET_COLUMNS_WIDE = [
    *BUDGET_COLUMNS,
    ("unspent_epsilon", "DOUBLE"),
    ("unspent_delta", "DOUBLE"),
    ("rho_cap", "DOUBLE"),
    ("charged_epsilon", "DOUBLE"),
    ("charged_delta", "DOUBLE"),
    ("gaussian_rho", "DOUBLE"),
]


def show_budget(
    service: Service, analyst: str, settings: Settings | None = None, *, wide: bool = False
) -> Result:
    """``SHOW budget`` (``wide``: ``SHOW budget WIDE``): the analyst's own spent and
    remaining budget (costs nothing). The columns: :data:`BUDGET_COLUMNS`.

    One ε view and one ρ: ``spent_epsilon``/``spent_delta`` are the (ε, δ) the spending
    amounts to as the filter converts it (the better of the pure sum and the zCDP
    conversion); ``spent_rho`` the zCDP total Σ zrho the filter compares with its cap;
    ``remaining_epsilon`` the largest ε one more pure-ε release may take;
    ``queries_left`` how many more releases of the session's per-query ε fit (the policy's
    default without a session). Under [budgets], the remaining figures and
    ``queries_left`` are the smallest over every budget the analyst's charges must fit;
    ``binding_limit`` names the one with the least ε left ("analyst", "group NAME",
    "dataset") and ``period`` its current period (NULL: it never renews). The wide form
    adds ``unspent_*`` (the budget minus the guarantee), ``rho_cap`` (the filter's ρ
    cap) and the raw sums of the charges: ``charged_epsilon`` (pure-ε releases),
    ``charged_delta`` and ``gaussian_rho`` (Gaussian releases), which add up charge by
    charge.
    """
    from dpsql.privacy.accounting import Cost
    from dpsql.privacy.budget_rules import rules_of

    dataset = service.policy.dataset
    per_query = Cost(epsilon=settings.epsilon if settings is not None else service.policy.epsilon)
    # Every budget a charge must fit ([budgets]: groups, the dataset-wide cap, renewal),
    # where the ledger can tell: the remaining figures are those of the binding one.
    limits_of = getattr(service.ledger, "limits", None)
    if limits_of is not None and rules_of(service.policy.budget) is not None:
        limits = limits_of(analyst, dataset, service.policy.budget)
        budget, spent = limits[0].budget, limits[0].spent
        lefts = [lim.remaining for lim in limits]
        eps_left, delta_left = min(e for e, _ in lefts), min(d for _, d in lefts)
        bound = min(limits, key=lambda lim: lim.remaining)
        binding, period = bound.label, bound.period or None
        fits = [lim.budget.queries_left(lim.spent, per_query) for lim in limits]
    else:
        budget = service.ledger.budget(analyst, dataset, service.policy.budget)
        spent = service.ledger.spent(analyst, dataset)
        eps_left, delta_left = budget.remaining(spent)
        binding, period = "analyst", None
        fits = [budget.queries_left(spent, per_query)]
    eps_spent, delta_spent = budget.guarantee(spent)
    eps_unspent, delta_unspent = budget.unspent(spent)
    values = {
        "analyst": analyst,
        "spent_epsilon": eps_spent,
        "budget_epsilon": budget.epsilon,
        "remaining_epsilon": eps_left,
        "spent_delta": delta_spent,
        "budget_delta": budget.delta,
        "remaining_delta": delta_left,
        "spent_rho": spent.zrho,
        "queries_left": min(fits) if service.policy.epsilon > 0 else None,
        "binding_limit": binding,
        "period": period,
        "unspent_epsilon": eps_unspent,
        "unspent_delta": delta_unspent,
        "rho_cap": budget.rho,
        "charged_epsilon": spent.epsilon,
        "charged_delta": spent.delta,
        "gaussian_rho": spent.rho,
    }
    columns = BUDGET_COLUMNS_WIDE if wide else BUDGET_COLUMNS
    return Result(columns, [tuple(values[name] for name, _ in columns)], status="SHOW")
