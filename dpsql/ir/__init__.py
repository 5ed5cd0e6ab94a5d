"""The typed plan tree: relational nodes with their stability, measurements with their
privacy maps (dpsql.ir.relational, dpsql.ir.measures), built from a plan (dpsql.ir.build) and
checked against what it charges (dpsql.ir.check)."""
