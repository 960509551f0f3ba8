"""The launcher: the `tf2sync` command and `python -m tf2sync`.

Beside the protocol (the rest of `tf2sync/_src`), which it uses as a user
would. `launch` runs a role; `flags` defines the launcher's flags,
`input` and `flag_checks` refuse bad input before any task starts,
`job_contract` checks what a job module gives; `chief` and `chief_report`
train and report on the chief; `local_tasks` starts the local mode's
tasks (forks of a `forker`, or new interpreters) and `processes` ties
every process to the launcher; `console` keeps TensorFlow's C++ log off
the local mode's console; `jobset` reads a JobSet pod's cluster. The job
modules stay in `tf2sync/_src/jobs`, the package `--job_module` names.
"""
