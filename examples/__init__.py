"""The runnable examples (a package, so that `--job_module=examples...` imports
from the repository's root)."""
