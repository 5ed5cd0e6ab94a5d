"""The service layer: what runs a bound statement (reserve, execute, release)."""
