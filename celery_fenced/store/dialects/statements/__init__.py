"""Every SQL statement of the SQL dialects, whole, as data.

One module per database: each statement a named ``LiteralString`` constant (or a mapping
of its variants) under a comment giving what it does, with named parameters
(``%(task_id)s``). The dialects pick a statement and pass a dict; no SQL is assembled at
call time (``tests/unit/test_sql_as_data.py`` checks both). Column lists that several
statements share are defined once, in :mod:`.common`, and joined to the statements at
import time.
"""
