"""What the chief prints and returns once `fit` ends (`chief.train`).

The job's model evaluated on its `eval_arrays()` in a local copy (the
`tf2sync: eval ...` line), then the final line: the job's own metrics
(`final_metrics`: its `METRICS`, or the loss when it has none) and the
synchronous counts, as `name=value` pairs that scripts parse.
"""

from __future__ import annotations

from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import liveness
from tf2sync._src import sharding
from tf2sync._src.launcher import job_contract


def evaluate(job, model):
    """`model`'s loss and metrics on the job's eval arrays, in a local copy.

    Prints them on one line (`tf2sync: eval loss=... accuracy=...`).

    Returns:
      A dict of metric name to float, as `evaluate(return_dict=True)`.
    """
    x, y = job_contract.call(job, "eval_arrays")
    local = job_contract.call(job, "build_model")
    local.set_weights(sharding.whole_weights(model.weights))
    # A new function would wait for a frozen worker (see liveness.py).
    local.compile(
        loss=job.LOSS,
        metrics=list(job.METRICS),
        run_eagerly=liveness.any_frozen(),
    )
    values = local.evaluate(x, y, verbose=0, return_dict=True)
    metrics = {k: float(v) for k, v in values.items()}
    print(
        "tf2sync: eval " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
        flush=True,
    )
    return metrics


def final_metrics(metrics: dict) -> dict:
    """What the final line shows of `evaluate`'s `metrics`: the job's own
    (`METRICS`), or its loss when it has none."""
    own = {k: float(v) for k, v in metrics.items() if k != "loss"}
    return own or {"loss": float(metrics["loss"])}


def _metrics_text(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in final_metrics(metrics).items())


def shim_totals(model, metrics, seconds: float):
    """The TF1 shim's totals, printed and returned."""
    # TF1's global step (the checkpointed `optimizer.iterations`) counts
    # every update of this run and of the runs it resumed; the shim does
    # not count stale gradients (TF1 drops them silently).
    totals = {
        **final_metrics(metrics),
        "sync_steps_applied": int(model.optimizer.iterations.numpy()),
        "seconds": round(seconds, 2),
    }
    print(
        f"{_metrics_text(metrics)} "
        f"sync_steps_applied={totals['sync_steps_applied']}",
        flush=True,
    )
    return totals


def sync_totals(optimizer, metrics, seconds: float, num_workers: int):
    """The `SyncOptimizer`'s totals, printed and returned."""
    counts = callbacks_lib.sync_totals(optimizer)
    totals = {
        **final_metrics(metrics),
        "sync_steps_applied": counts["sync_steps"],
        "stale_gradients_dropped": counts["stale_dropped"],
        "accepted_per_worker": [
            counts[f"accepted_w{i}"] for i in range(num_workers)
        ],
        "over_plan_dropped": counts["over_plan_dropped"],
        "seconds": round(seconds, 2),
    }
    # Pushes of functions re-run after a fault, dropped once an epoch had
    # its planned updates (see `Aggregator.plan_updates`).
    over = totals["over_plan_dropped"]
    print(
        f"{_metrics_text(metrics)} "
        f"sync_steps_applied={totals['sync_steps_applied']} "
        f"stale_gradients_dropped={totals['stale_gradients_dropped']} "
        f"accepted_per_worker={totals['accepted_per_worker']}"
        + (f" over_plan_dropped={over}" if over else ""),
        flush=True,
    )
    return totals
