"""tf2sync.SyncOptions: validation, frozen-ness, and who reads it."""

import dataclasses

import numpy as np
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync
from tf2sync._src import options as options_lib


class SyncOptionsTest(parameterized.TestCase):
    def test_defaults(self):
        self.assertEqual(tf2sync.SyncOptions().max_unrolled_steps, 10)
        self.assertIn("SyncOptions", tf2sync.__all__)

    @parameterized.named_parameters(("zero", 0), ("negative", -3))
    def test_a_non_positive_count_is_refused(self, value):
        with self.assertRaisesRegex(
            ValueError,
            r"^`max_unrolled_steps` must be a positive int. Received: "
            rf"max_unrolled_steps={value}$",
        ):
            tf2sync.SyncOptions(max_unrolled_steps=value)

    @parameterized.named_parameters(
        ("str", "4"), ("float", 2.5), ("bool", True), ("none", None)
    )
    def test_a_non_int_is_refused(self, value):
        with self.assertRaisesRegex(
            TypeError,
            r"^`max_unrolled_steps` must be a positive int. Received: "
            rf"max_unrolled_steps={value!r} \(of type",
        ):
            tf2sync.SyncOptions(max_unrolled_steps=value)

    def test_a_numpy_int_becomes_an_int(self):
        options = tf2sync.SyncOptions(max_unrolled_steps=np.int64(4))
        self.assertIs(type(options.max_unrolled_steps), int)
        self.assertEqual(options, tf2sync.SyncOptions(max_unrolled_steps=4))

    def test_frozen_and_replaced_with_validation(self):
        options = tf2sync.SyncOptions()
        with self.assertRaises(dataclasses.FrozenInstanceError):
            options.max_unrolled_steps = 3
        self.assertEqual(
            dataclasses.replace(options, max_unrolled_steps=3),
            tf2sync.SyncOptions(max_unrolled_steps=3),
        )
        with self.assertRaisesRegex(ValueError, "max_unrolled_steps=0"):
            dataclasses.replace(options, max_unrolled_steps=0)
        self.assertEqual(options.max_unrolled_steps, 10)

    def test_check_and_of_strategy(self):
        self.assertEqual(options_lib.check(None), tf2sync.SyncOptions())
        with self.assertRaisesRegex(
            TypeError, r"`options` must be a tf2sync.SyncOptions or None"
        ):
            options_lib.check({"max_unrolled_steps": 4})
        # A strategy without tf2sync's options: the defaults.
        self.assertEqual(
            options_lib.of_strategy(object()), tf2sync.SyncOptions()
        )

    def test_trainer_refuses_other_options_before_any_cluster(self):
        with self.assertRaisesRegex(
            TypeError,
            r"`options` must be a tf2sync.SyncOptions or None. Received: "
            r"options=4",
        ):
            tf2sync.Trainer(
                strategy=None, model=None, optimizer=None, options=4
            )


class StrategyOptionsTest(absltest.TestCase):
    def test_strategy_takes_options_and_refuses_anything_else(self):
        with self.assertRaisesRegex(
            TypeError,
            r"`options` must be a tf2sync.SyncOptions or None. Received: "
            r"options=\{'max_unrolled_steps': 4\}",
        ):
            testutil.strategy(
                replicas_to_aggregate=2, options={"max_unrolled_steps": 4}
            )
        options = tf2sync.SyncOptions(max_unrolled_steps=4)
        strategy = testutil.strategy(replicas_to_aggregate=2, options=options)
        self.assertIs(strategy.options, options)
        self.assertEqual(options_lib.of_strategy(strategy), options)


if __name__ == "__main__":
    absltest.main()
