"""The SQL front end's relational layer: what runs between parsing and binding."""
