"""DP-GreedyRL: differentially private rule lists (Ly et al. 2024), see docs/rulelist.md.

- :class:`DPGreedyRuleList`: scikit-learn-style estimator on 0/1 features;
- :func:`plan_rule_list` / :func:`release_rule_list`: the SQL table function ``dp_rule_list``;
- :mod:`dpsql.rulelist.gini`: criterion, local and smooth sensitivity, support threshold.
"""

from dpsql.rulelist.candidates import Feature, Literal, mined_candidates, public_candidates
from dpsql.rulelist.estimator import DPGreedyRuleList
from dpsql.rulelist.learner import MECHANISMS, LearnerParams, learn, plan_budget
from dpsql.rulelist.model import LearnedRule, RuleList
from dpsql.rulelist.table_function import (
    RuleListPlan,
    RuleListRelease,
    plan_rule_list,
    release_rule_list,
)

__all__ = [
    "MECHANISMS",
    "DPGreedyRuleList",
    "Feature",
    "LearnedRule",
    "LearnerParams",
    "Literal",
    "RuleList",
    "RuleListPlan",
    "RuleListRelease",
    "learn",
    "mined_candidates",
    "plan_budget",
    "plan_rule_list",
    "public_candidates",
    "release_rule_list",
]
