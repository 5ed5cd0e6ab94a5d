"""Analyst SQL -> bound query -> sensitivity-annotated plan -> engine SQL."""
