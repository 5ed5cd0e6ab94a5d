"""Noise, calibration, accounting and the budget ledger."""
