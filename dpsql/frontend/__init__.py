"""Text -> bound tree: parsing, the relational rewrites before binding (scopes, derived tables
and CTEs, joins, per-unit relations, released-table post-processing, spellings), the binder
(``bind/``) and the tree it emits (``statements.py``), with each node's properties (types,
totality, interval arithmetic). Nothing here reads data or knows a plan (dpsql.plan) or a
lowering (dpsql.lower): tests/test_layering.py checks the flow.
"""
