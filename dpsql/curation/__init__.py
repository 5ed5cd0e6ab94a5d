"""Putting data behind dpsql: ``dpsql init`` drafts a policy from a source, ``dpsql check``
validates one against its sources and says what each table will release.

Both read the private data, as the curator's own tools: what they print is for the operator,
never for an analyst. Nothing here is used on the query path.
"""
