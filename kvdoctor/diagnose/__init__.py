"""`kvdoctor diagnose LOG`: from the crash an operator saw to a known bug and a verdict.

`logline` cleans one line, `pyrepr` reads the `non-default args:` dict text,
`serveline` finds version and serve arguments, `traceback` assembles
tracebacks per process, `reader` streams a log through them, `match` ranks
the built-in recipes against the crash, `app` runs the matches. Nothing read
from a log is executed or evaluated.
"""
