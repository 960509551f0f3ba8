"""The launcher's sharding flags and the clicks job (real processes)."""

import re

import procutil
import pytest
from absl.testing import absltest
from absl.testing import parameterized

_launch = procutil.launch


class ShardingFlagTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("max_shards", ["--max_shards=0"], "--max_shards=0"),
        ("min_shard_bytes", ["--min_shard_bytes=-1"], "--min_shard_bytes=-1"),
        ("num_ps", ["--num_ps=0"], "--num_ps=0"),
    )
    def test_non_positive_values_exit_2_naming_the_flag(self, args, value):
        out = _launch(args, timeout=60)
        name = value.split("=")[0]
        procutil.assert_refused(
            self, out, f"{name} must be a positive int. Received: {value}\n"
        )

    def test_num_ps_conflicting_with_local_cluster(self):
        out = _launch(["--num_ps=3", "--local_cluster=2,1"], timeout=60)
        procutil.assert_refused(
            self,
            out,
            "--num_ps=3 conflicts with --local_cluster=2,1 (1 ps): give one "
            "of them, or make them agree.\n",
        )


class PartitionerFromFlagsTest(absltest.TestCase):
    """What `--min_shard_bytes` / `--max_shards` give the strategy."""

    def _shards(self, shape, **config):
        import tensorflow as tf

        from tf2sync._src.launcher import chief

        partitioner = chief.variable_partitioner(
            chief.ChiefConfig(**config), num_ps=2
        )
        if partitioner is None:
            return None
        return partitioner(tf.TensorShape(shape), tf.float32)[0]

    def test_unset_means_no_partitioner(self):
        self.assertIsNone(self._shards([1_000_000, 32]))

    def test_max_shards_alone_splits_only_large_variables(self):
        self.assertEqual(self._shards([1_000_000, 32], max_shards=3), 3)
        self.assertEqual(self._shards([32, 64], max_shards=3), 1)  # 8 KiB

    def test_min_shard_bytes_alone_caps_at_the_number_of_ps(self):
        self.assertEqual(self._shards([1024, 8], min_shard_bytes=1000), 2)
        self.assertEqual(self._shards([10, 8], min_shard_bytes=1000), 1)


class ClicksJobTest(absltest.TestCase):
    @pytest.mark.slow
    def test_small_table_sharded_over_two_ps_learns(self):
        out = _launch(
            [
                "--job_module=tf2sync._src.jobs.clicks",
                "--num_ps=2",
                "--max_shards=2",
                "--min_shard_bytes=40000",
                "--clicks_vocab_size=2000",
                "--clicks_num_train=8000",
                "--nounroll_steps",
            ]
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("2 workers, 2 ps", out.stdout)
        self.assertIn(
            "MinSizePartitioner(min_shard_bytes=40000, max_shards=2)",
            out.stdout,
        )
        # The table in two halves, one on each ps.
        shards = re.search(
            r"tf2sync: embedding/embeddings \[2000, 32\] in 2 shards: "
            r"part_0 \[1000, 32\] on ps:(\d), part_1 \[1000, 32\] on ps:(\d)",
            out.stdout,
        )
        self.assertIsNotNone(shards, out.stdout)
        self.assertCountEqual(shards.groups(), ["0", "1"])
        # The dense kernels (8 KiB at most) stay whole.
        self.assertLen(re.findall(r" shards: ", out.stdout), 1)
        self.assertIn("Epoch 2/2", out.stdout)  # FLAG_DEFAULTS' 2 epochs
        auc = re.search(r"tf2sync: eval .*auc=(\S+)", out.stdout)
        self.assertIsNotNone(auc, out.stdout)
        # Chance is 0.5; two epochs reach about 0.8 here.
        self.assertGreater(float(auc.group(1)), 0.65)
        self.assertIn("stale_gradients_dropped=0", out.stdout)


if __name__ == "__main__":
    absltest.main()
