"""Annotated plan -> what an engine runs: SQL trees and column programs, never analyst text.

``compile.py`` lowers a plan to engine SQL (or to the prepared store's plan,
``prepared_plan.py``); both build from the same node constructors (``builders.py``) and the
bounded plan's shared steps (``bounding.py``: the guarded WHERE, per-(unit, group) row
selection by keyed hash (``hashing.py``), rescaling, G-group scaling). ``row_values.py`` is one
row's value, clamp and fixed point; ``local_plan.py`` the numpy column programs; ``rows.py``
the bounded row inputs of the table functions; ``totality.py`` a test oracle over the output.
"""
