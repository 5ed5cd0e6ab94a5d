"""The wire server's shortcuts write the same bytes as the general encoders they bypass:
NoticeResponse written out in one expression, and a connection's remembered RowDescriptions."""

from __future__ import annotations

import itertools

from dpsql.server import protocol as p
from dpsql.server import session as session_module
from dpsql.server import types as t
from dpsql.server.extended import row_description
from dpsql.server.session import Session


def test_notice_response_is_the_general_field_encoding():
    texts = ["dpsql: charged epsilon=0.1 delta=0.0 rho=0.0; 9.9 left", "", "é ü ☃ 'x'"]
    for code, text, hint, severity in itertools.product(
        ["00000", "01000"], texts, [None, "", "raise the budget"], ["NOTICE", "WARNING"]
    ):
        fast = p.notice_response(code, text, hint=hint, severity=severity)
        general = p.message(b"N", p._fields(severity, code, text, {"H": hint or ""}))
        assert fast == general, (code, text, hint, severity)
        fields = p.parse_error_fields(fast[5:])
        assert fields["S"] == fields["V"] == severity and fields["C"] == code
        assert fields["M"] == text and fields.get("H", "") == (hint or "")


def _session() -> Session:
    s = Session.__new__(Session)  # only the RowDescription memory is used
    s._descriptions = {}
    return s


def test_remembered_row_descriptions_are_the_built_ones_and_bounded(monkeypatch):
    s = _session()
    columns = (("count", t.INT8), ("department", t.TEXT))
    formats = (0, 0)
    first = s._row_description(columns, formats)
    assert first == row_description(columns, formats)
    assert s._row_description(columns, formats) is first  # remembered
    other = (("count", t.INT8), ("dept", t.TEXT))
    assert s._row_description(other, formats) == row_description(other, formats) != first
    assert s._row_description(columns, (1, 0)) == row_description(columns, (1, 0)) != first
    # per connection: another session builds its own
    assert _session()._descriptions == {}
    # bounded: forgotten all at once when full, still the built bytes after
    monkeypatch.setattr(session_module, "_DESCRIPTIONS", 4)
    for i in range(10):
        cols = ((f"c{i}", t.INT8),)
        assert s._row_description(cols, (0,)) == row_description(cols, (0,))
        assert len(s._descriptions) <= 4
    # columns in a list (unhashable): built each time, never stored
    listed = [("relname", t.TEXT)]
    assert s._row_description(listed, (0,)) == row_description(listed, (0,))
    assert all(key[0] != listed for key in s._descriptions)
