"""Engines run compiled plans and return exact bounded aggregates; no privacy logic here."""
