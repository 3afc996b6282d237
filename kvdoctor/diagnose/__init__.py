"""`kvdoctor diagnose LOG`: from the crash an operator saw to a known bug and a verdict.

`logline` cleans one line, `pyrepr` reads the `non-default args:` dict text,
`serveline` finds version and serve arguments, `traceback` assembles
tracebacks per process, `evidence` keeps what lies outside whole tracebacks
(loose frames, statements, exception lines), `reader` streams a log through
them, `statement` compares statements structurally, `sites` measures each
known bug's crash statement in every release's installed source (the data
`match` weighs evidence against), `match` names the bugs that fit and how
strongly, `app` runs the matches. Nothing read from a log is executed or
evaluated.
"""
