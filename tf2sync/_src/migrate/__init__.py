"""`python -m tf2sync.migrate`: the distributed-TF1 constructs of programs.

`finder` reads a program's syntax tree (never imports or runs it),
`table` maps each construct to its TF2 / tf2sync form and the section of
`docs/migrating.md` that explains it, and `cli` is the command.
"""
