"""The curator page: a read-only web page for the operator (``dpsql dashboard``, ``dpsql serve
--admin-port``). :mod:`dpsql.admin.page` reads and renders, :mod:`dpsql.admin.server` serves it
over HTTP with the operator's credentials, :mod:`dpsql.admin.cli` adds the command line.
docs/curator.md describes it."""

#: The operator's default login name on the page.
DEFAULT_USER = "operator"
