"""Local-mode GPU assignment (`local_tasks.gpu_plan`), without a GPU."""

from absl.testing import absltest
from absl.testing import parameterized

from tf2sync._src.launcher import local_tasks


class GpuPlanTest(parameterized.TestCase):
    @parameterized.parameters(
        # (workers, per worker, GPUs on the machine, visible, shared)
        (2, 1, 2, ["0", "1"], False),  # one each
        (2, 2, 4, ["0,1", "2,3"], False),
        (2, 1, 1, ["0", "0"], True),  # one GPU, both workers on it
        (3, 1, 2, ["0", "1", "0"], True),
        (2, 2, 3, ["0,1", "2,0"], True),
        (2, 3, 2, ["0,1", "0,1"], True),  # asks more than there are
        (2, 0, 2, ["", ""], False),  # --num_gpus=0: CPU
        (2, 1, 0, ["", ""], False),  # no GPU (the launcher refuses it)
    )
    def test_plan(self, workers, per_worker, available, visible, shared):
        self.assertEqual(
            local_tasks.gpu_plan(workers, per_worker, available),
            (visible, shared),
        )


if __name__ == "__main__":
    absltest.main()
