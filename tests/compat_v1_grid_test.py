"""The shim against TF1 on a grid of embedding-style models.

What TF1 users migrate most is one SyncReplicasOptimizer over several
gathered embedding tables (sparse `IndexedSlices` gradients) and some dense
variables. compat_v1_test.py compares the shim with TF1 on one model (two
dense variables and one sparse one); this file compares it, line for line,
on a grid of cells: 1 to 4 tables, 0 to 4 dense variables (scalars and
[2, 3] matrices), 2 or 3 workers, 1 or 2 ps, with and without a backup
worker, phases of sequential steps (the startup's wasted step, then stale
gradients that are dropped) and concurrent ones, at least 4 applied rounds
per cell. compat_v1_grid_reference.py runs TF1's real optimizer in graph
mode on the same cells; each line compared is, after each phase, the
global step, every variable's values and every worker's local step. The
gradients come from a linear forward pass through `tf.gather` (one cell
passes them as constants): per-worker constants, so both sides compute
the same numbers. Row ids are sorted and a row repeats within a push only
where TF1's accumulator still averages per row (see `sparse_ids`). Two
cells partition their variables (issue 18): TF1's `PartitionedVariable`s
of `fixed_size_partitioner` (2 and 3 parts over the 2 ps) against the
shim on a strategy with `variable_partitioner`, each variable's line its
shards concatenated.

It exists because the shim hung on exactly these models (2 workers, 1 ps:
three tables never finish their first round; two tables hung in the third
round; two tables and two dense variables hung too): every phase here is
bounded, and a shim that hangs fails with the cell and phase that hung.

In-process servers cannot be stopped, so this process hosts only the
3-worker, 2-ps cluster compat_v1_test.py uses too; the 2-worker, 1-ps cells
run the shim in a subprocess (this file's `--shim` mode).
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback

import compat_v1_grid_reference as reference
import numpy as np
import pytest
import tensorflow as tf
import testutil
from absl.testing import absltest

from tf2sync._src import sharding
from tf2sync._src import strategy as strategy_lib
from tf2sync.compat import v1 as compat_v1

# About 1.5 minutes on 2 cores (the two partitioned cells about 35 s of
# it); both methods share the subprocesses started in setUpClass.
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# A phase's steps (and a cell's tracing and hook) finish in about a second;
# TF1 finishes every phase below (see the reference's lines). A shim step
# that has not finished after this long waits for a token or a take that
# nothing will give it: the shim hung.
PHASE_TIMEOUT = 60.0
# After a phase, how long the shim may take to apply the round TF1 applied.
SETTLE_TIMEOUT = 20.0
REFERENCE_TIMEOUT = 240.0
SUBPROCESS_TIMEOUT = 300.0
# The strategy's watchdog is on, with its default timeout, as a user's:
# no phase here needs a released token in TF1, and the watchdog's drain
# must not give one while a step is still computing before its push
# (on a loaded 2-core machine a round can take over its 1 s).
TOKEN_TIMEOUT = 60.0

# Each cell's phases were checked against TF1's token protocol: none waits
# for a token TF1 would never give, and none races (a concurrent phase
# never completes a round with fewer than all its fresh pushes, nor takes
# tokens of different values). `final_step` is TF1's last global step.
CELLS_3W2PS = [
    {  # no backup: every round needs all three workers
        "name": "s1d3_w3",
        "sparse": 1,
        "dense": 3,
        "workers": 3,
        "ps": 2,
        "rta": 3,
        "total": 3,
        "num_tokens": 5,
        "phases": [[0], [1], [2], [0], [1], [2], [0, 1]] + [[0, 1, 2]] * 4,
        "final_step": 5,
    },
    {  # 2 replicas on the 3-worker cluster; worker 0 fills round 1 alone
        "name": "s2d1_w2",
        "sparse": 2,
        "dense": 1,
        "workers": 2,
        "ps": 2,
        "rta": 2,
        "total": 2,
        "num_tokens": 4,
        "phases": [[0], [0], [1], [0], [1], [1], [0, 1]] + [[0, 1]] * 3,
        "final_step": 5,
    },
    {  # a backup worker: 2 of 3 gradients per round, the late one dropped
        "name": "s4d4_backup",
        "sparse": 4,
        "dense": 4,
        "workers": 3,
        "ps": 2,
        "rta": 2,
        "total": 3,
        "num_tokens": 3,
        "phases": [
            [0],
            [2],
            [1],
            [0],
            [1],
            [2],
            [0, 1],
            [2],
            [0, 1],
            [2],
            [1, 2],
            [0],
            [0, 2],
            [1],
            [0, 1],
        ],
        "final_step": 6,
    },
    # Partitioned variables (issue 18): TF1's `PartitionedVariable`s of
    # `fixed_size_partitioner(n)` (tables and the [2, 3] matrix), read with
    # `embedding_lookup(partition_strategy="div")`, against the shim on a
    # strategy with `variable_partitioner`: each shard aggregated on its own
    # ps. 7 rows: uneven parts, and table 0's ids (0 to 3) leave a part of
    # it without a gradient in every push. The phases are s1d3_w3's and
    # s4d4_backup's (the token protocol does not depend on the variables).
    {  # 2 parts, TF1's partitioner given to the strategy, `minimize`
        "name": "p2_s2d2_w3",
        "partition": 2,
        "partitioner": "tf1",
        "shim_grads": "minimize",
        "vocab": 7,
        "sparse": 2,
        "dense": 2,
        "workers": 3,
        "ps": 2,
        "rta": 3,
        "total": 3,
        "num_tokens": 5,
        "phases": [[0], [1], [2], [0], [1], [2], [0, 1]] + [[0, 1, 2]] * 4,
        "final_step": 5,
    },
    {  # 3 parts, FixedShardsPartitioner, a backup worker, per-shard grads
        "name": "p3_s2d2_backup",
        "partition": 3,
        "partitioner": "tf2",
        "shim_grads": "tape",
        "vocab": 7,
        "sparse": 2,
        "dense": 2,
        "workers": 3,
        "ps": 2,
        "rta": 2,
        "total": 3,
        "num_tokens": 3,
        "phases": [
            [0],
            [2],
            [1],
            [0],
            [1],
            [2],
            [0, 1],
            [2],
            [0, 1],
            [2],
            [1, 2],
            [0],
            [0, 2],
            [1],
            [0, 1],
        ],
        "final_step": 6,
    },
]

_TWO_WORKERS = {"workers": 2, "ps": 1, "rta": 2, "total": 2}
_STARTUP = [[0], [1], [0], [1]]  # round 1, then the wasted, dropped steps
CELLS_2W1PS = [
    dict(  # the constant gradients of compat_v1_test, no forward pass
        _TWO_WORKERS,
        name="s1d0",
        forward="constant",
        sparse=1,
        dense=0,
        num_tokens=2,
        phases=_STARTUP + [[0, 1]] * 4,
        final_step=5,
    ),
    dict(  # the reported hang: 2 tables, in the third round, 1 run in 2
        _TWO_WORKERS,
        name="s2d0_long",
        sparse=2,
        dense=0,
        num_tokens=4,
        phases=_STARTUP + [[0], [1]] + [[0, 1]] * 5,
        final_step=6,
    ),
    dict(  # the reported hang: 2 tables and 2 dense variables
        _TWO_WORKERS,
        name="s2d2",
        sparse=2,
        dense=2,
        num_tokens=2,
        phases=_STARTUP + [[0, 1]] * 4,
        final_step=5,
    ),
    dict(  # the reported hang: 3 tables never finish the first round
        _TWO_WORKERS,
        name="s3d0",
        sparse=3,
        dense=0,
        num_tokens=2,
        phases=_STARTUP + [[0, 1]] * 4,
        final_step=5,
    ),
]


class ShimHung(Exception):
    """A cell's phase did not finish: the cluster is unusable after it."""


def _constants(cell):
    """Each variable's gradients for every worker, stacked on axis 0."""
    per_worker = [reference.gradients(cell, w) for w in range(cell["workers"])]
    stacked = []
    for grads in zip(*per_worker):
        if isinstance(grads[0], tuple):
            stacked.append(tuple(np.stack(part) for part in zip(*grads)))
        else:
            stacked.append(np.stack(grads))
    return stacked


def _partitioner(cell):
    """The strategy's `variable_partitioner` for `cell`, None unless sharded."""
    if not cell.get("partition"):
        return None
    if cell["partitioner"] == "tf1":
        return tf.compat.v1.fixed_size_partitioner(cell["partition"])
    return tf.distribute.experimental.partitioners.FixedShardsPartitioner(
        cell["partition"]
    )


def _value(var):
    """A variable's value; a sharded one's shards concatenated."""
    if sharding.is_sharded(var):
        return np.concatenate([s.numpy() for s in var.variables])
    return var.numpy()


def _cell_steps(cell, cluster_workers, num_ps, expected_steps, report):
    """Runs `cell` on the shim; `report(event)` after each stage.

    Drives the shim as compat_v1_test's `_Harness` does: a traced step per
    worker index, `make_session_run_hook(True, num_tokens)` after tracing,
    one `coordinator.join()` per phase. A partitioned cell reads its
    `ShardedVariable` tables with `tf.nn.embedding_lookup` and applies
    through `minimize(loss, var_list=[the ShardedVariables, ...])` or a
    tape over the shards, one list of gradients per `ShardedVariable`.
    """
    name, num_workers = cell["name"], cell["workers"]
    strategy = testutil.strategy(
        cluster_workers,
        num_ps,
        replicas_to_aggregate=cell["rta"],
        total_num_replicas=cell["total"],
        token_timeout=TOKEN_TIMEOUT,
        variable_partitioner=_partitioner(cell),
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():  # round robin over the ps, in creation order
        global_step = tf.Variable(
            0, name=f"{name}_global_step", trainable=False
        )
        variables = [
            tf.Variable(init, name=f"{name}_{vname}")
            for vname, init in reference.variable_specs(cell)
        ]
        opt = compat_v1.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(reference.LR),
            replicas_to_aggregate=cell["rta"],
            total_num_replicas=cell["total"],
        )
    # A shard is placed as TF1's replica_device_setter placed a part.
    for k, var in enumerate(sharding.shards([global_step, *variables])):
        task = reference.ps_task(k, num_ps)
        suffix = f"/job:ps/replica:0/task:{task}/device:CPU:0"
        if not var.device.endswith(suffix):
            raise AssertionError(f"{var.name} on {var.device}, not {suffix}")
    constants = _constants(cell)
    dense_shape = [reference.vocab(cell), reference.DIM]

    @tf.function
    def step(w):
        def replica(w):
            grads = []
            for c in constants:
                if isinstance(c, tuple):
                    ids, values = c
                    grads.append(
                        tf.IndexedSlices(
                            tf.gather(tf.constant(values), w),
                            tf.gather(tf.constant(ids), w),
                            tf.constant(dense_shape, tf.int64),
                        )
                    )
                else:
                    grads.append(tf.gather(tf.constant(c), w))
            if cell.get("forward", "gather") != "gather":
                return opt.apply_gradients(zip(grads, variables), global_step)

            def loss():
                # The forward pass reads every variable, as a model would;
                # it is linear, so its gradients are the constants above.
                return tf.add_n(
                    [
                        tf.reduce_sum(_lookup(v, g.indices) * g.values)
                        if isinstance(g, tf.IndexedSlices)
                        else tf.reduce_sum(v * g)
                        for v, g in zip(variables, grads)
                    ]
                )

            if cell.get("shim_grads") == "minimize":
                return opt.minimize(loss, global_step, var_list=variables)
            flat = sharding.shards(variables)
            with tf.GradientTape() as tape:
                value = loss()
            flat_grads = iter(tape.gradient(value, flat))
            grads = [
                [next(flat_grads) for _ in v.variables]
                if sharding.is_sharded(v)
                else next(flat_grads)
                for v in variables
            ]
            return opt.apply_gradients(zip(grads, variables), global_step)

        with strategy_lib._WorkerScope(w):
            return strategy.run(replica, args=(w,))

    step.get_concrete_function(tf.TensorSpec([], tf.int64))
    hook = opt.make_session_run_hook(True, cell["num_tokens"])
    hook.begin()
    hook.after_create_session()
    report(("started", None))
    for k, phase in enumerate(cell["phases"]):
        for w in phase:
            coordinator.schedule(step, args=(tf.constant(w, tf.int64),))
        coordinator.join()
        _settle(global_step, expected_steps[k] if expected_steps else None)
        line = [float(global_step.numpy())]
        for var in variables:
            line += np.ravel(_value(var)).astype(float).tolist()
        line += [float(s) for s in opt.local_steps.numpy()[:num_workers]]
        report(("phase", line))
    hook.end()
    report(("done", None))


def _lookup(var, ids):
    if sharding.is_sharded(var):
        return tf.nn.embedding_lookup(var, ids)
    return tf.gather(var, ids)


def _settle(global_step, target):
    """Waits until no round is pending on the shim.

    The round is applied by the push that completes it, so by the time a
    phase's `join` returns it has been; the wait is a guard that costs
    nothing when it holds: at most SETTLE_TIMEOUT until the global step
    reaches TF1's `target`, then until it is unchanged across two reads
    0.3 s apart.
    """
    deadline = time.time() + SETTLE_TIMEOUT
    while target is not None and int(global_step.numpy()) < target:
        if time.time() > deadline:
            break
        time.sleep(0.05)
    previous = int(global_step.numpy())
    while True:
        time.sleep(0.3)
        current = int(global_step.numpy())
        if current == previous or time.time() > deadline:
            return
        previous = current


def run_shim_cell(cell, cluster_workers, num_ps, expected_steps=None):
    """The cell's lines on the shim; raises ShimHung if a stage never ends.

    The cell runs on a daemon thread; this waits at most PHASE_TIMEOUT for
    each stage (tracing and the hook, each phase's `coordinator.join()`
    and settle, the final `hook.end()`), so a hung shim fails the cell
    instead of hanging the test process.
    """
    events = queue.Queue()

    def target():
        try:
            _cell_steps(
                cell, cluster_workers, num_ps, expected_steps, events.put
            )
        except BaseException as e:  # noqa: BLE001 - re-raised below
            events.put(("error", e))

    threading.Thread(target=target, daemon=True).start()
    stages = (
        ["tracing and starting the hook"]
        + [f"phase {k} {p}" for k, p in enumerate(cell["phases"])]
        + ["hook.end()"]
    )
    lines = []
    for stage in stages:
        try:
            kind, value = events.get(timeout=PHASE_TIMEOUT)
        except queue.Empty:
            raise ShimHung(
                f"cell {cell['name']} {stage} did not finish in "
                f"{PHASE_TIMEOUT:.0f} s: the shim hung (lines so far: "
                f"{len(lines)}, global steps {[x[0] for x in lines]})"
            ) from None
        if kind == "error":
            raise value
        if kind == "phase":
            lines.append(value)
    return lines


def _labels(cell):
    labels = ["global_step"]
    for vname, init in reference.variable_specs(cell):
        labels += [f"{vname}{list(i)}" for i in np.ndindex(np.shape(init))]
    labels += [f"local_step[{w}]" for w in range(cell["workers"])]
    return labels


def _popen(*args):
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=ROOT),
        text=True,
    )


def _communicate(proc, timeout):
    """(returncode, stdout, stderr); the process is killed by PID if late."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {timeout:.0f} s"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


class _Side:
    """One side's subprocess run on a thread: TF1's lines or the shim's."""

    def __init__(self, run):
        self.procs = []
        self.result = None
        self._thread = threading.Thread(target=self._main, args=(run,))
        self._thread.daemon = True
        self._thread.start()

    def _main(self, run):
        try:
            self.result = run(self)
        except BaseException as e:  # noqa: BLE001 - re-raised in get()
            self.result = e

    def communicate(self, timeout, *args):
        proc = _popen(*args)
        self.procs.append(proc)
        return _communicate(proc, timeout)

    def get(self):
        self._thread.join(REFERENCE_TIMEOUT + SUBPROCESS_TIMEOUT + 30)
        if self._thread.is_alive():
            raise AssertionError("a subprocess side did not finish")
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def kill(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)


def _reference_side(cells, after=None):
    """TF1's lines per cell: `(lines or None, error)`, once `after` is done."""

    def run(side):
        if after is not None:
            after.get()
        code, out, err = side.communicate(
            REFERENCE_TIMEOUT,
            os.path.join(HERE, "compat_v1_grid_reference.py"),
            json.dumps(cells),
        )
        if code != 0:
            return None, f"TF1 reference failed ({code}): {err[-3000:]}"
        lines = {c["name"]: [] for c in cells}
        for line in out.strip().splitlines():
            name, *numbers = line.split()
            lines[name].append([float(x) for x in numbers])
        return lines, None

    return run


def _subprocess_side(cells, reference):
    """The shim's results per cell, in a subprocess, after TF1's lines."""

    def run(side):
        expected, error = reference.get()
        if error is not None:
            return None, expected, error
        steps = {c["name"]: [x[0] for x in expected[c["name"]]] for c in cells}
        code, out, err = side.communicate(
            SUBPROCESS_TIMEOUT,
            os.path.abspath(__file__),
            "--shim",
            json.dumps({"cells": cells, "steps": steps}),
        )
        results = {}
        for line in out.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                results[result["cell"]] = result
        return results, expected, f"shim subprocess exit code {code}: {err}"

    return run


class GridTest(absltest.TestCase):
    """Each cell's lines on the shim equal TF1's (atol 1e-5)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # TF1's 3-worker reference first; then, beside the in-process
        # cells, the 2-worker reference and the shim subprocess. Each runs
        # on a cluster of its own and waits until its rounds settle, so no
        # number depends on the load (2 cores: more at once only slows all).
        cls._reference_3w2ps = _Side(_reference_side(CELLS_3W2PS))
        reference_2w1ps = _Side(
            _reference_side(CELLS_2W1PS, after=cls._reference_3w2ps)
        )
        cls._sides = [
            cls._reference_3w2ps,
            reference_2w1ps,
            _Side(_subprocess_side(CELLS_2W1PS, reference_2w1ps)),
        ]

    @classmethod
    def tearDownClass(cls):
        for side in cls._sides:
            side.kill()
        super().tearDownClass()

    def _check_reference(self, cells, expected, error):
        if error is not None:
            self.fail(error)
        for cell in cells:
            lines = expected[cell["name"]]
            self.assertLen(lines, len(cell["phases"]), cell["name"])
            # Not vacuous: TF1 applied the rounds the phases were made for.
            self.assertEqual(lines[-1][0], cell["final_step"], cell["name"])

    def _check_cell(self, cell, got, expected):
        name = cell["name"]
        labels = _labels(cell)
        self.assertLen(got, len(expected), name)
        for k, (g, e) in enumerate(zip(got, expected)):
            self.assertLen(g, len(labels), f"{name} phase {k}")
            bad = [
                f"{label}: shim {a:.6g}, TF1 {b:.6g}"
                for label, a, b in zip(labels, g, e)
                if not abs(a - b) <= 1e-5
            ]
            np.testing.assert_allclose(
                g,
                e,
                atol=1e-5,
                err_msg=f"cell {name} phase {k} {cell['phases'][k]}: "
                + "; ".join(bad[:12]),
            )
        self.assertEqual(got[-1][0], cell["final_step"], name)

    def test_in_process_3_workers_2_ps(self):
        cells = CELLS_3W2PS
        expected, error = self._reference_3w2ps.get()
        self._check_reference(cells, expected, error)
        for i, cell in enumerate(cells):
            name = cell["name"]
            with self.subTest(cell=name):
                hung = None
                try:
                    got = run_shim_cell(
                        cell, 3, 2, [x[0] for x in expected[name]]
                    )
                except ShimHung as e:
                    hung = str(e)
                if hung is not None:
                    self.fail(hung)
                self._check_cell(cell, got, expected[name])
            if hung is not None:
                rest = [c["name"] for c in cells[i + 1 :]]
                if rest:
                    self.fail(
                        f"{hung}. This process's cluster is unusable now; "
                        f"cells not run: {rest}"
                    )
                break

    def test_subprocess_2_workers_1_ps(self):
        cells = CELLS_2W1PS
        results, expected, error = self._sides[2].get()
        if results is None:
            self.fail(error[-3000:])
        self._check_reference(cells, expected, None)
        hung = None
        for cell in cells:
            with self.subTest(cell=cell["name"]):
                result = results.get(cell["name"])
                if result is None and hung is not None:
                    self.fail(f"cell {cell['name']} not run: {hung}")
                elif result is None:
                    self.fail(f"cell {cell['name']} not run: {error[-2000:]}")
                elif "hung" in result:
                    hung = result["hung"]
                    self.fail(hung)
                elif "error" in result:
                    self.fail(result["error"])
                self._check_cell(cell, result["lines"], expected[cell["name"]])


def _shim_main(argument):
    """`--shim` mode: the 2-worker, 1-ps cells, one JSON line per cell."""
    spec = json.loads(argument)
    for cell in spec["cells"]:
        result = {"cell": cell["name"]}
        try:
            result["lines"] = run_shim_cell(
                cell, cell["workers"], cell["ps"], spec["steps"][cell["name"]]
            )
        except ShimHung as e:
            result["hung"] = str(e)
        except Exception:  # noqa: BLE001 - reported to the parent
            result["error"] = traceback.format_exc()
        print(json.dumps(result), flush=True)
        if "hung" in result:
            break  # the cluster is unusable
    sys.stdout.flush()
    os._exit(0)  # a hung step's threads would hold a normal exit


if __name__ == "__main__":
    if sys.argv[1:2] == ["--shim"]:
        _shim_main(sys.argv[2])
    else:
        absltest.main()
