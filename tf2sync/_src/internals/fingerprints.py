"""Fingerprints of the TensorFlow and tf_keras sources tf2sync copies.

Where tf2sync copies the body of a TF or tf_keras function to run it with
a change (TF's `Worker._process_closure`, for one), the copy is right for
the source it was copied from. The module holding a copy lists it in its
`COPIED_SOURCES`: the original, the copy, what to re-check, and the hash
of `inspect.getsource(original)` (`fingerprint`) for each version the copy
was checked against. `tests/fingerprints_test.py` fails, naming the
function and what to re-check, when the installed version's source
differs, and skips a version with no recorded fingerprint (the 2.15 CI
environment's sources were not at hand here).

After re-checking a copy against a new version, record that version's
fingerprint: `fingerprints.fingerprint(original)`.
"""

from __future__ import annotations

import hashlib
import inspect
import typing

import tensorflow as tf
import tf_keras


class CopiedSource(typing.NamedTuple):
    """A TF or tf_keras function whose body tf2sync copies."""

    original: typing.Any  # the function copied
    name: str  # where it is, for the reader
    copy: str  # tf2sync's copy
    recheck: str  # what to re-check when its source changes
    package: str  # "tensorflow" or "tf_keras": whose version keys `hashes`
    hashes: dict  # "major.minor" -> `fingerprint(original)` checked there


def fingerprint(function) -> str:
    """The first 16 hex digits of the SHA-256 of `function`'s source."""
    source = inspect.getsource(function)
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def installed_version(package: str) -> str:
    """`major.minor` of the installed "tensorflow" or "tf_keras"."""
    module = {"tensorflow": tf, "tf_keras": tf_keras}[package]
    return ".".join(module.__version__.split(".")[:2])
