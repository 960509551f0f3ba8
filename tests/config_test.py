"""SyncConfig: validation and derived counts, no cluster needed."""

from absl.testing import absltest
from absl.testing import parameterized

from tf2sync._src import config


class SyncConfigTest(parameterized.TestCase):
    @parameterized.named_parameters(
        # (rta, total, tokens_per_step, backups): TF1's observed values.
        ("balanced", 2, 2, 2, 0),
        ("backups", 2, 4, 4, 2),
        ("accumulation", 4, 2, 4, 0),
        ("total_none_means_rta", 3, None, 3, 0),
    )
    def test_derived_counts(self, rta, total, tokens, backups):
        c = config.SyncConfig.create(rta, total)
        self.assertEqual(c.tokens_per_step, tokens)
        self.assertEqual(c.num_backup_replicas, backups)
        self.assertEqual(c.total_num_replicas, total or rta)

    def test_numpy_int_is_accepted(self):
        import numpy as np

        self.assertEqual(
            config.SyncConfig.create(np.int64(2)).replicas_to_aggregate, 2
        )

    @parameterized.named_parameters(
        ("bool", True, TypeError, "Received: replicas_to_aggregate=True"),
        ("none", None, TypeError, "Received: replicas_to_aggregate=None"),
        ("negative", -3, ValueError, "Received: replicas_to_aggregate=-3"),
    )
    def test_rejects(self, value, error, message):
        with self.assertRaisesRegex(error, message):
            config.SyncConfig.create(value)

    def test_backup_note_says_what_backups_cost(self):
        # 1 of 2 on equal workers drops about half the pushes as stale
        # (issue 55 measured 71 of 176 in an epoch), and nothing said so.
        self.assertIsNone(config.SyncConfig.create(2, 2).backup_note())
        self.assertIsNone(config.SyncConfig.create(4, 2).backup_note())
        note = config.SyncConfig.create(1, 2).backup_note()
        self.assertIn("first 1 of 2 pushes", note)
        self.assertIn("about 50% of the pushes", note)
        self.assertIn("about 33%", config.SyncConfig.create(2, 3).backup_note())


if __name__ == "__main__":
    absltest.main()
