"""Examples/s of tf2sync against stock (asynchronous) PSS, side by side.

One process, one in-process cluster on 127.0.0.1 (2 workers + 1 ps by
default); every system gets a fresh strategy on it, and the repeats are
interleaved (A B C A B C ...) so that machine noise hits all systems alike.
Reported: JSON lines per run, then medians and ratios to `pss_async_loop`.

Systems:
  local            one process, no distribution, global batch N*B.
  pss_async_loop   stock ParameterServerStrategy, custom loop, K steps/fn.
  pss_async_fit    stock PSS through model.fit, steps_per_execution=K.
  tf2sync_loop     tf2sync custom loop, K synchronous steps/fn.
  tf2sync_fit      tf2sync through model.fit, steps_per_execution=K.

Sync examples/s count only aggregated gradients (accepted pushes x B).
Models, data and the optimizer (momentum SGD, `--optimizer`) come from
benchmarks/workloads.py; benchmarks/harness.py is the fuller comparison
(TF1 SyncReplicasOptimizer, MultiWorkerMirroredStrategy, stragglers,
scaling, ps memory).

  python benchmarks/sync_vs_async.py --workload=w1 --repeats=3
"""

import json
import os
import statistics
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import systems  # noqa: E402
import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import tf2sync  # noqa: E402

_WORKLOAD = flags.DEFINE_enum("workload", "w1", ["w1", "w2", "w3"], "Model.")
_SYSTEMS = flags.DEFINE_list(
    "systems",
    ["local", "pss_async_loop", "pss_async_fit", "tf2sync_loop", "tf2sync_fit"],
    "Systems to run.",
)
_WORKERS = flags.DEFINE_integer("workers", 2, "Worker tasks.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Interleaved repeats.")
_FUNCTIONS = flags.DEFINE_integer("functions", 40, "Timed functions per run.")
_K = flags.DEFINE_integer("steps_per_function", 10, "Steps per function.")
_OUTPUT = flags.DEFINE_string("output", None, "Append JSON lines here.")
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer",
    "legacy",
    ["legacy", "keras"],
    "Momentum SGD family (see benchmarks/workloads.py).",
)

BATCH = workloads.BATCH
build_model = workloads.build_model
make_data = workloads.make_data
loss_fn = workloads.loss_fn
keras_loss = workloads.keras_loss
dataset = workloads.dataset


def run_local(workload, workers, k, functions):
    batch = BATCH[workload] * workers
    model = build_model(workload)
    opt = workloads.optimizer(_OPTIMIZER.value)
    loss = loss_fn(workload)
    it = iter(dataset(workload, batch))

    @tf.function
    def train(iterator):
        for _ in tf.range(k):
            x, y = next(iterator)
            with tf.GradientTape() as tape:
                value = loss(y, model(x))
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

    train(it)
    start = time.perf_counter()
    for _ in range(functions):
        train(it)
    seconds = time.perf_counter() - start
    return functions * k * batch / seconds


def run_loop(strategy, workload, k, functions, sync):
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    batch = BATCH[workload]
    loss = loss_fn(workload)
    with strategy.scope():
        model = build_model(workload)
        opt = systems.make_optimizer(model, _OPTIMIZER.value, sync)
    it = iter(
        coordinator.create_per_worker_dataset(lambda: dataset(workload, batch))
    )

    def replica(data):
        x, y = data
        with tf.GradientTape() as tape:
            value = loss(y, model(x))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train(iterator):
        for _ in tf.range(k):
            strategy.run(replica, args=(next(iterator),))

    for _ in range(4):
        coordinator.schedule(train, args=(it,))
    coordinator.join()
    before = _pushes(opt, sync)
    start = time.perf_counter()
    for _ in range(functions):
        coordinator.schedule(train, args=(it,))
    coordinator.join()
    seconds = time.perf_counter() - start
    pushes = _pushes(opt, sync) - before if sync else functions * k
    return pushes * batch / seconds


def _pushes(opt, sync):
    return int(opt.gradients_accepted.numpy()) if sync else 0


class _Timer(tf.keras.callbacks.Callback):
    """Times fit from on_train_begin to on_train_end (DESIGN_NOTES C)."""

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self.start


def run_fit(strategy, workload, k, functions, sync):
    batch = BATCH[workload]
    with strategy.scope():
        model = build_model(workload)
        inner = workloads.optimizer(_OPTIMIZER.value)
        opt = tf2sync.SyncOptimizer(inner) if sync else inner
        model.compile(
            optimizer=opt, loss=keras_loss(workload), steps_per_execution=k
        )
    ds = dataset(workload, batch)
    model.fit(ds, epochs=1, steps_per_epoch=4 * k, verbose=0)
    before = _pushes(opt, sync)
    timer = _Timer()
    model.fit(
        ds,
        epochs=1,
        steps_per_epoch=functions * k,
        verbose=0,
        callbacks=[timer],
    )
    pushes = _pushes(opt, sync) - before if sync else functions * k
    return pushes * batch / timer.seconds


def main(argv):
    del argv
    workload, workers = _WORKLOAD.value, _WORKERS.value
    k, functions = _K.value, _FUNCTIONS.value
    resolver = tf2sync.testing.local_cluster(workers, 1)
    results = {s: [] for s in _SYSTEMS.value}
    for repeat in range(_REPEATS.value):
        for system in _SYSTEMS.value:
            if system == "local":
                value = run_local(workload, workers, k, functions)
            else:
                sync = system.startswith("tf2sync")
                if sync:
                    strategy = tf2sync.SyncParameterServerStrategy(
                        resolver, replicas_to_aggregate=workers
                    )
                else:
                    strategy = (
                        tf.distribute.experimental.ParameterServerStrategy(
                            resolver
                        )
                    )
                runner = run_fit if system.endswith("fit") else run_loop
                value = runner(strategy, workload, k, functions, sync)
            results[system].append(value)
            line = json.dumps(
                {
                    "workload": workload,
                    "system": system,
                    "repeat": repeat,
                    "workers": workers,
                    "steps_per_function": k,
                    "examples_per_sec": round(value, 1),
                }
            )
            print(line, flush=True)
            if _OUTPUT.value:
                with open(_OUTPUT.value, "a") as f:
                    f.write(line + "\n")
    base = statistics.median(results.get("pss_async_loop") or [1.0])
    print(
        f"\n| system ({workload}, {workers} workers) | median ex/s | "
        "vs pss_async_loop |"
    )
    print("|---|---|---|")
    for system, values in results.items():
        median = statistics.median(values)
        print(f"| {system} | {median:,.0f} | {median / base:.2f} |")


if __name__ == "__main__":
    app.run(main)
    os._exit(0)
