"""Bound tree -> sensitivity-annotated plan: contribution bounds, measures, mechanisms.

The planner (``planner.py``) annotates the binder's tree (dpsql.frontend.statements) into the
plan's values (``values.py``); ``tree.py`` gives the plan as typed relational nodes with their
stability (``relational.py``) and measurements with their privacy maps (``measures.py``);
``check.py`` verifies the charge against those maps; ``canonical.py`` is the one text every
cache key derives from. Public key domains (``domains.py``), the ε split and shared measures
(``sharing.py``), the bias measures (``bias.py``), the default clamp's histogram as data
(``clamp_spec.py``) and the measure kinds (``measure_kinds.py``) complete it.
"""
