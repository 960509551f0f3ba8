"""What the chief prints and returns once `fit` ends (`chief.train`).

The job's model evaluated on its `eval_arrays()` in a local copy (the
`tf2sync: eval ...` line), then the final line: the job's own metrics
(`final_metrics`: its `METRICS`, or the loss when it has none) and the
synchronous counts, as `name=value` pairs that scripts parse.
"""

from __future__ import annotations

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


def sync_totals(sync, metrics, seconds: float, num_workers: int):
    """The totals of `sync` (a `trainer_sync` adapter), printed and
    returned: the job's metrics, the updates applied (the global step,
    with the runs this one resumed), and what the optimizer counts: the
    TF1 shim nothing else (TF1 drops stale gradients silently)."""
    counts = sync.totals()
    totals = {
        **final_metrics(metrics),
        "sync_steps_applied": counts["sync_steps"],
    }
    line = f"{_metrics_text(metrics)} sync_steps_applied={counts['sync_steps']}"
    if sync.counts:
        totals["stale_gradients_dropped"] = counts["stale_dropped"]
        totals["accepted_per_worker"] = [
            counts[f"accepted_w{i}"] for i in range(num_workers)
        ]
        totals["over_plan_dropped"] = over = counts["over_plan_dropped"]
        line += (
            f" stale_gradients_dropped={totals['stale_gradients_dropped']}"
            f" accepted_per_worker={totals['accepted_per_worker']}"
        )
        # Pushes of functions re-run after a fault, dropped once an epoch
        # had its planned updates (see `Aggregator.plan_updates`).
        line += f" over_plan_dropped={over}" if over else ""
    totals["seconds"] = round(seconds, 2)
    print(line, flush=True)
    return totals
