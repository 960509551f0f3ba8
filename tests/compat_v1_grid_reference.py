"""TF1's real SyncReplicasOptimizer on a grid of embedding-style models.

Usage: compat_v1_grid_reference.py '<json list of cells>'

The reference side of compat_v1_grid_test.py, a generalisation of
compat_v1_tf1_reference.py to the models TF1 users migrate most: one
optimizer over several sparse tables (gathered embeddings) and dense
variables. Each cell is a dict:

* `name`: prefixes its variables (ps resources persist across sessions by
  name) and names the graph container of its queues and accumulators
  (TF1's token queue has the fixed shared name `sync_token_q`);
* `sparse` (1-4): tables `t0..`, shape [VOCAB, DIM], each trained through an
  `IndexedSlices` gradient (row ids and values per worker and table, see
  `sparse_ids` and `gradients`; table 0 repeats a row within one push);
* `dense` (0-4): variables `d0..`, scalars and [2, 3] matrices alternately;
* `workers` (2 or 3), `ps` (1 or 2): the workers the cell uses and the ps
  tasks; `rta`, `total`, `num_tokens`: the optimizer's and the hook's;
* `forward` (default "gather"): "gather" computes the gradients with a
  forward pass that reads every variable (`tf.gather` of the tables), as a
  model does; it is linear, so they are the constants of `gradients`.
  "constant" passes those constants to `apply_gradients` directly;
* `phases`: lists of worker indices; the workers of one phase step
  concurrently (one `session.run(train_op)` each);
* `partition` (optional, n >= 2): TF1 code with partitioned variables:
  every variable of rank >= 1 (tables and matrices) is a
  `PartitionedVariable` of `tf.compat.v1.get_variable(...,
  partitioner=tf.compat.v1.fixed_size_partitioner(n))` (at most one part
  per row, the first parts one row longer: "div" order), all variables
  placed by `tf.compat.v1.train.replica_device_setter` (round robin over
  the ps in creation order, part by part), the tables read with
  `tf.compat.v1.nn.embedding_lookup(..., partition_strategy="div")` (an
  `IndexedSlices` gradient per part, empty for a part no id falls in), the
  partitions listed one by one in `compute_gradients`' `var_list`; a
  partitioned variable's line holds its parts concatenated. `vocab`
  (default VOCAB) sets the tables' rows, so parts can be uneven.

Every cell of one invocation runs on one in-process cluster (127.0.0.1,
free ports) of `max(workers)` workers and the cells' common `ps` count,
started once; each cell builds fresh graphs and sessions. Variables are
created global step first, then the tables, then the dense ones, and
placed round robin over the ps tasks in that order, as
ParameterServerStrategy places them. The optimizer is
GradientDescentOptimizer(LR); gradients are constants computed from the
worker index, so the shim side computes the very same numbers.

After each phase it waits until no round is pending (the chief's round
thread takes asynchronously: until the global step and every
accumulator's count are still and below `rta`) and prints one line: `name
global_step <every variable's values, flattened, in creation order>
<local step of each of the cell's workers>`. Exits with os._exit: the
chiefs' queue-runner threads stay blocked in a take.
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf2sync.testing import cluster_spec_dict  # noqa: E402

VOCAB, DIM = 6, 2
LR = 0.5
DENSE_MATRIX = (2, 3)
PHASE_TIMEOUT = 60.0  # TF1's steps of one phase take well under a second


def vocab(cell):
    """The tables' rows."""
    return cell.get("vocab", VOCAB)


def variable_specs(cell):
    """`[(name, initial float32 array)]` after the global step, in order."""
    specs = []
    for i in range(cell["sparse"]):
        rows = np.arange(vocab(cell) * DIM).reshape(vocab(cell), DIM)
        specs.append((f"t{i}", (1.0 + i + 0.1 * rows).astype(np.float32)))
    for i in range(cell["dense"]):
        if i % 2:
            matrix = np.arange(6).reshape(DENSE_MATRIX)
            specs.append((f"d{i}", (0.1 * matrix - i).astype(np.float32)))
        else:
            specs.append((f"d{i}", np.float32(2.0 + i)))
    return specs


def sparse_ids(table, worker, rows=VOCAB):
    """Row ids of `worker`'s push to table `table`: 3, sorted.

    Table 0 pushes row `worker` twice (as `tf.gather`'s gradient does for
    a repeated id) and row 3, shared by all workers, once. TF1's
    SparseConditionalAccumulator merges pushes as sorted lists and does not
    deduplicate: a row repeated in one push and pushed a different number
    of times by another is not averaged per row (the shim sums duplicates
    within a push first, see docs/migrating.md), so a repeated row is one
    only its worker pushes. The other tables push 3 distinct rows, some
    shared between workers, some not.
    """
    if table == 0:
        return np.array([worker, worker, 3], np.int64)
    ids = {(table + worker) % rows, (table + 3) % rows}
    ids.add((table + 4 + worker) % rows)
    return np.array(sorted(ids), np.int64)


def gradients(cell, worker):
    """Per variable of `variable_specs`: `(ids, values)` or a dense array."""
    grads = []
    for i in range(cell["sparse"]):
        k = np.arange(3, dtype=np.float64).reshape(3, 1)
        c = np.arange(DIM, dtype=np.float64).reshape(1, DIM)
        values = 0.1 * (worker + 1) + 0.05 * i + 0.02 * k - 0.03 * c * worker
        ids = sparse_ids(i, worker, vocab(cell))
        grads.append((ids, values.astype(np.float32)))
    for i in range(cell["dense"]):
        if i % 2:
            matrix = np.arange(6).reshape(DENSE_MATRIX)
            g = 0.01 * matrix + 0.1 * (worker + 1) + 0.02 * i
            grads.append(g.astype(np.float32))
        else:
            grads.append(np.float32(0.1 + 0.2 * worker + 0.05 * i))
    return grads


def ps_task(index, num_ps):
    """The ps task of the `index`-th variable created (0: global step)."""
    return index % num_ps


def _constant_grad(g, rows):
    if isinstance(g, tuple):
        return tf.IndexedSlices(
            tf.constant(g[1]),
            tf.constant(g[0]),
            tf.constant([rows, DIM], tf.int64),
        )
    return tf.constant(g)


def _part_initializer(full):
    """An initializer of `full`'s rows of the part it is called for."""

    def initializer(shape, dtype=None, partition_info=None):
        offset = 0 if partition_info is None else partition_info.var_offset[0]
        rows = full[offset : offset + tf.TensorShape(shape)[0]]
        return tf.constant(rows, dtype=dtype)

    return initializer


def _partitioned_variables(cell, w, num_ps):
    """The global step, `cell`'s variables and each one's parts.

    TF1's partitioned way: a `PartitionedVariable` for each variable of
    rank >= 1 (its parts: `list(var)`).
    """
    name = cell["name"]
    partitioner = tf.compat.v1.fixed_size_partitioner(cell["partition"])
    setter = tf.compat.v1.train.replica_device_setter(
        ps_tasks=num_ps, worker_device=f"/job:worker/task:{w}"
    )
    with tf.compat.v1.device(setter):
        global_step = tf.compat.v1.get_variable(
            f"{name}_global_step",
            initializer=tf.constant(0, tf.int64),
            trainable=False,
        )
        variables, parts = [], []
        for vname, init in variable_specs(cell):
            if np.ndim(init) == 0:
                var = tf.compat.v1.get_variable(
                    f"{name}_{vname}", initializer=tf.constant(init)
                )
                parts.append([var])
            else:
                var = tf.compat.v1.get_variable(
                    f"{name}_{vname}",
                    shape=init.shape,
                    dtype=tf.float32,
                    initializer=_part_initializer(init),
                    partitioner=partitioner,
                )
                parts.append(list(var))
            variables.append(var)
    return global_step, variables, parts


def _build_worker(cell, w, num_ps):
    """One worker's graph of `cell`: train op, hook and what to read."""
    name = cell["name"]
    graph = tf.Graph()
    # Containers allow no "_".
    with graph.as_default(), graph.container(name.replace("_", "-")):
        if cell.get("partition"):
            if cell.get("forward", "gather") != "gather":
                raise ValueError("A partitioned cell's forward is `gather`.")
            global_step, variables, parts = _partitioned_variables(
                cell, w, num_ps
            )
        else:
            with tf.device(f"/job:ps/task:{ps_task(0, num_ps)}"):
                global_step = tf.compat.v1.Variable(
                    0, name=f"{name}_global_step", trainable=False
                )
            variables = []
            for k, (vname, init) in enumerate(variable_specs(cell), start=1):
                with tf.device(f"/job:ps/task:{ps_task(k, num_ps)}"):
                    variables.append(
                        tf.compat.v1.Variable(init, name=f"{name}_{vname}")
                    )
            parts = [[v] for v in variables]
        var_list = [p for v in parts for p in v]
        with tf.device(f"/job:worker/task:{w}"):
            constants = gradients(cell, w)
            sync = tf.compat.v1.train.SyncReplicasOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(LR),
                replicas_to_aggregate=cell["rta"],
                total_num_replicas=cell["total"],
            )
            if cell.get("forward", "gather") == "gather":
                # A forward pass that reads every variable; linear, so its
                # gradients are the constants (IndexedSlices for the tables).
                loss = tf.add_n(
                    [
                        tf.reduce_sum(_lookup(v, g[0], cell) * g[1])
                        if isinstance(g, tuple)
                        # A `PartitionedVariable` has no `*`: its parts
                        # concatenated.
                        else tf.reduce_sum(tf.convert_to_tensor(v) * g)
                        for v, g in zip(variables, constants)
                    ]
                )
                grads_and_vars = sync.compute_gradients(loss, var_list)
            else:
                grads_and_vars = zip(
                    [_constant_grad(g, vocab(cell)) for g in constants],
                    var_list,
                )
            train_op = sync.apply_gradients(grads_and_vars, global_step)
            hook = sync.make_session_run_hook(
                w == 0, num_tokens=cell["num_tokens"]
            )
        counts = [acc.num_accumulated() for acc, _ in sync._accumulator_list]
        # A partitioned variable's value: its parts concatenated.
        reads = [tf.concat(p, 0) if len(p) > 1 else p[0] for p in parts]
    return graph, hook, train_op, global_step, reads, sync, counts


def _lookup(table, ids, cell):
    if cell.get("partition"):
        return tf.compat.v1.nn.embedding_lookup(
            table, ids, partition_strategy="div"
        )
    return tf.gather(table, ids)


def _step(session, train_op, errors):
    try:
        session.run(train_op)
    except Exception as e:  # noqa: BLE001 - reported by run_cell
        errors.append(e)


def run_cell(cell, servers, config, num_ps):
    num_workers, rta = cell["workers"], cell["rta"]
    sessions, built = [], []
    for w in range(num_workers):  # the chief first: it initializes
        graph, hook, *rest = _build_worker(cell, w, num_ps)
        built.append(rest)
        with graph.as_default():
            sessions.append(
                tf.compat.v1.train.MonitoredTrainingSession(
                    master=servers[w].target,
                    is_chief=w == 0,
                    config=config,
                    hooks=[hook],
                    stop_grace_period_secs=1,
                )
            )
    _, gs, variables, _, counts = built[0]

    def settle():
        previous = None
        while True:
            state = sessions[0].run([gs, counts])
            state = (state[0], *state[1])
            if max(state[1:]) < rta and state == previous:
                return state[0]
            previous = state
            time.sleep(0.3)

    for k, phase in enumerate(cell["phases"]):
        errors = []
        threads = [
            threading.Thread(
                target=_step,
                args=(sessions[w], built[w][0], errors),
                daemon=True,
            )
            for w in phase
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PHASE_TIMEOUT)
        if errors or any(t.is_alive() for t in threads):
            # A phase that waits for a token TF1 never gives is a bad cell.
            print(
                f"cell {cell['name']} phase {k} {phase}: TF1's steps "
                f"{'failed: ' + repr(errors) if errors else 'never finished'}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(2)
        settle()
        step, values = sessions[0].run([gs, variables])
        local = [
            sessions[w].run(built[w][3]._local_step) for w in range(num_workers)
        ]
        flat = [step] + [x for v in values for x in np.ravel(v)] + local
        print(cell["name"], " ".join(repr(float(x)) for x in flat))
        sys.stdout.flush()
    # The sessions stay open: closing them waits for the chief's queue
    # runner, blocked in its next take.


def main(cells):
    if len({c["ps"] for c in cells}) != 1:
        raise ValueError("The cells of one invocation share their ps count.")
    num_ps = cells[0]["ps"]
    num_workers = max(c["workers"] for c in cells)
    tf.compat.v1.disable_eager_execution()
    spec = cluster_spec_dict(num_workers, num_ps)
    cluster = tf.train.ClusterSpec({"worker": spec["worker"], "ps": spec["ps"]})
    config = tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=max(4, num_workers + 1)
    )
    servers = [
        tf.distribute.Server(cluster, job_name=job, task_index=i, config=config)
        for job, n in (("worker", num_workers), ("ps", num_ps))
        for i in range(n)
    ]
    for cell in cells:
        run_cell(cell, servers, config, num_ps)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
