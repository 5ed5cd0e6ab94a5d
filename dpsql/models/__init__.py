"""Stored DP models: the store (:mod:`.store`), SQL prediction (:mod:`.predict`), CLI.

Learners (rule lists in :mod:`dpsql.rulelist`, regressions here) release a model once, with
DP; storing and applying it afterwards is post-processing.
"""
