"""The TF and tf_keras sources tf2sync copies are the ones it copied.

Each module of `tf2sync._src.internals` that copies the body of a TF or
tf_keras function lists it in its `COPIED_SOURCES` (see
`internals/fingerprints.py`). This fails, naming the function and what to
re-check, when the installed version's source differs from the one the
copy was checked against, and skips a version with no recorded
fingerprint.
"""

import importlib
import pkgutil

from absl.testing import absltest

from tf2sync._src import internals
from tf2sync._src.internals import fingerprints


def copied_sources():
    """Every `CopiedSource` of the internals modules."""
    found = []
    for module in pkgutil.iter_modules(internals.__path__):
        loaded = importlib.import_module(f"{internals.__name__}.{module.name}")
        found.extend(getattr(loaded, "COPIED_SOURCES", ()))
    return found


class FingerprintTest(absltest.TestCase):
    def test_the_copies_are_listed(self):
        names = {source.name.rsplit(".", 1)[-1] for source in copied_sources()}
        self.assertContainsSubset(
            {"_process_closure", "save_own_variables", "load_own_variables"},
            names,
        )

    def test_copied_sources_are_unchanged(self):
        checked = 0
        for source in copied_sources():
            version = fingerprints.installed_version(source.package)
            with self.subTest(source.name):
                if version not in source.hashes:
                    self.skipTest(
                        f"{source.package} {version}: no fingerprint "
                        f"recorded for {source.name} (recorded: "
                        f"{sorted(source.hashes)}); check {source.copy} "
                        "against its source, then record "
                        "fingerprints.fingerprint(original)"
                    )
                actual = fingerprints.fingerprint(source.original)
                self.assertEqual(
                    actual,
                    source.hashes[version],
                    f"The source of {source.name} changed in "
                    f"{source.package} {version} ({actual}), and "
                    f"{source.copy} copies it. Re-check {source.recheck}; "
                    "then update the copy and record the new fingerprint "
                    f"for {version} in its COPIED_SOURCES.",
                )
                checked += 1
        if not checked:
            self.skipTest("no fingerprint recorded for the installed versions")

    def test_fingerprint_is_of_the_source(self):
        def one():
            return 1

        def two():
            return 2

        self.assertLen(fingerprints.fingerprint(one), 16)
        self.assertNotEqual(
            fingerprints.fingerprint(one), fingerprints.fingerprint(two)
        )


if __name__ == "__main__":
    absltest.main()
