"""The job-module contract: refused in one line before start, and the
README's table is the contract's."""

import os
import types

import numpy as np
import tensorflow as tf
from absl import app
from absl.testing import absltest

from tf2sync._src.launcher import chief_report
from tf2sync._src.launcher import job_contract

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(**overrides):
    """A module with every name of the contract, as a job writes them."""
    names = dict(
        build_model=lambda: tf.keras.Sequential([tf.keras.layers.Dense(1)]),
        train_dataset=lambda input_context, batch_size: None,
        eval_arrays=lambda: (np.zeros([2, 1]), np.zeros([2])),
        num_train_examples=lambda: 8,
        LOSS="mse",
        METRICS=["accuracy"],
    )
    names.update(overrides)
    job = types.ModuleType("my_job")
    for name, value in names.items():
        if value is not None:
            setattr(job, name, value)
    return job


class CheckTest(absltest.TestCase):
    def _refused(self, job, *, evaluator=False, steps_per_epoch=None):
        with self.assertRaises(app.UsageError) as raised:
            job_contract.check(
                job,
                "my_job",
                evaluator=evaluator,
                steps_per_epoch=steps_per_epoch,
            )
        self.assertEqual(raised.exception.exitcode, 2)
        message = str(raised.exception)
        self.assertNotIn("\n", message)
        self.assertTrue(message.startswith("--job_module=my_job: "), message)
        return message

    def test_a_complete_job_passes(self):
        job_contract.check(
            _job(), "my_job", evaluator=False, steps_per_epoch=None
        )
        # Optional names, defined with the launcher's arguments.
        job_contract.check(
            _job(
                build_optimizer=lambda learning_rate, momentum: None,
                optimizer_groups=lambda learning_rate: [],
                train_pass=lambda batch_size, *rest: None,
                callbacks=lambda: [],
                FLAG_DEFAULTS={"epochs": 2},
            ),
            "my_job",
            evaluator=False,
            steps_per_epoch=None,
        )

    def test_missing_names_all_in_one_line(self):
        message = self._refused(_job(eval_arrays=None, LOSS=None))
        self.assertIn("lacks eval_arrays(), LOSS ", message)
        # The evaluator needs fewer names; num_train_examples only
        # without --steps_per_epoch.
        job_contract.check(
            _job(train_dataset=None, num_train_examples=None),
            "my_job",
            evaluator=True,
            steps_per_epoch=None,
        )
        job_contract.check(
            _job(num_train_examples=None),
            "my_job",
            evaluator=False,
            steps_per_epoch=3,
        )
        self.assertIn(
            "num_train_examples()", self._refused(_job(num_train_examples=None))
        )

    def test_a_signature_the_launcher_cannot_call(self):
        # build_optimizer is given (learning_rate, momentum): a job that
        # takes only the rate fails at the chief's start, not after the
        # cluster came up.
        message = self._refused(
            _job(build_optimizer=lambda learning_rate: None)
        )
        self.assertIn(
            "the launcher calls build_optimizer(learning_rate, momentum), "
            "and build_optimizer(learning_rate) cannot take that",
            message,
        )
        message = self._refused(_job(train_dataset=lambda batch_size: None))
        self.assertIn("train_dataset(input_context, batch_size)", message)
        self.assertIn("build_model", self._refused(_job(build_model=len)))

    def test_constants_of_the_wrong_type(self):
        message = self._refused(_job(METRICS="accuracy"))
        self.assertIn("Received: METRICS='accuracy'", message)
        self.assertIn(
            "must be a function",
            self._refused(_job(build_optimizer=tf.keras.optimizers.SGD())),
        )


class CallTest(absltest.TestCase):
    def test_what_a_function_returns_is_checked(self):
        job = _job(eval_arrays=lambda: np.zeros([2]))
        job.__name__ = "my_job"
        with self.assertRaisesRegex(
            TypeError,
            r"^--job_module=my_job: eval_arrays\(\) must return `\(x, y\)`"
            r".*Received: ndarray array",
        ):
            job_contract.call(job, "eval_arrays")
        with self.assertRaisesRegex(TypeError, "build_model"):
            job_contract.call(_job(build_model=lambda: None), "build_model")
        with self.assertRaisesRegex(TypeError, "num_train_examples"):
            job_contract.call(
                _job(num_train_examples=lambda: 0), "num_train_examples"
            )
        self.assertEqual(
            job_contract.call(
                _job(num_train_examples=lambda: np.int64(8)),
                "num_train_examples",
            ),
            8,
        )
        model = job_contract.call(_job(), "build_model")
        self.assertIsInstance(model, tf.keras.Model)


class FinalLineTest(absltest.TestCase):
    def test_the_jobs_own_metrics_or_its_loss(self):
        self.assertEqual(
            chief_report.final_metrics(
                {"loss": 0.5, "accuracy": 0.75, "auc": 0.875}
            ),
            {"accuracy": 0.75, "auc": 0.875},
        )
        # No METRICS: the loss, not accuracy=nan.
        self.assertEqual(
            chief_report.final_metrics({"loss": 0.5}), {"loss": 0.5}
        )


class ReadmeTest(absltest.TestCase):
    def test_readme_holds_the_contract(self):
        with open(os.path.join(ROOT, "README.md")) as f:
            self.assertIn(job_contract.markdown_table(), f.read())


if __name__ == "__main__":
    absltest.main()
