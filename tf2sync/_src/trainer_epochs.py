"""How `Trainer` runs an epoch: its loop functions and their schedule.

`EpochsMixin` is part of `trainer.Trainer` (see that class for the loop
and its guarantees): the functions of `steps_per_loop` steps (repeated
with `loops.repeat`, or a pass's loop of `ServicePassPerEpoch`), an
epoch's functions scheduled, joined and their logs read, and the epoch's
end (counted, checkpointed, printed).
"""

from __future__ import annotations

import collections
import time

import tensorflow as tf
import tf_keras

from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import coordinator as coordinator_lib
from tf2sync._src import loops
from tf2sync._src import step_context
from tf2sync._src.internals import autograph
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import ps_strategy


class EpochsMixin:
    """The epochs of `trainer.Trainer` (see the module docstring)."""

    def _loop_function(self, steps=None, traces=None):
        """The function of `steps` (default `steps_per_loop`) steps; it
        copies the step's trace from `traces` (a `loops.StepTraces`) if
        another function made it."""
        steps = self.steps_per_loop if steps is None else steps
        group = self._copies_per_group()

        @autograph.function_of_tf2sync
        def loop(iterator):
            def step(total, iterator):
                loss = self.strategy.run(
                    self.train_step, args=(next(iterator),)
                )
                return total + tf.cast(loss, tf.float32)

            total = loops.repeat(
                step,
                steps,
                group,
                tf.constant(0.0),
                trace_once=self._sync.trace_once,
                inputs=(iterator,),
                traces=traces,
            )
            return total / steps

        return loop

    def _single_step_loop(self, traces):
        """The function of one step that runs a `train` call's first loop
        as single steps, or None.

        As `fit`'s first call, where `loops.starts_on_single_steps` says
        so; not with the TF1 shim (its copies are traced per copy, ordered
        by its token).
        """
        if not self._sync.trace_once or not loops.starts_on_single_steps(
            self.steps_per_loop, self._copies_per_group()
        ):
            return None
        return self._loop_function(steps=1, traces=traces)

    def _copies_per_group(self) -> int:
        """Step copies per `loops.repeat` group, as `use_tf_while_loop` says."""
        return {
            None: self.options.max_unrolled_steps,
            True: 1,  # a tf.while_loop of single steps
            False: self.steps_per_loop,  # every step a copy in the graph
        }[self.use_tf_while_loop]

    def _pass_loop_function(self):
        """The loop of a `ServicePassPerEpoch` epoch (`data_service`, 3.).

        Each step runs only if its worker's iterator gave an element.
        Returns `(loss sum, steps run, worker, pass ended)`.
        """
        steps = self.steps_per_loop
        group = self._copies_per_group()

        @autograph.function_of_tf2sync
        def loop(iterator):
            def step(carry):
                total, ran, ended = carry
                element = iterator.get_next_as_optional()

                def run():
                    loss = self.strategy.run(
                        self.train_step, args=(element.get_value(),)
                    )
                    return total + tf.cast(loss, tf.float32), ran + 1, ended

                return tf.cond(
                    element.has_value(),
                    run,
                    lambda: (total, ran, tf.constant(True)),
                )

            start = (
                tf.constant(0.0),
                tf.constant(0, tf.int64),
                tf.constant(False),
            )
            total, ran, ended = loops.repeat(
                step, steps, group, start, trace_once=self._sync.trace_once
            )
            worker = step_context.current_worker()
            if worker is None:
                worker = tf.constant(-1, tf.int64)
            return total, ran, worker, ended

        return loop

    def _run_epoch(self, loop, iterator, position, single=None, rest_fn=None):
        """Schedules an epoch's functions, joins, and returns its logs.

        Args:
          loop: The `tf.function` from `_loop_function`.
          iterator: The per-worker iterator it reads.
          position: `(epoch, first step, steps per epoch)`: the epoch runs
            its steps from the first (not 0 where a save inside it was
            restored), as loops of `steps_per_loop`, then the rest (fewer)
            as functions of one step.
          single: The function of one step from `_single_step_loop`: the
            first loop runs as `steps_per_loop` of it. None: every loop is
            one `loop`.
          rest_fn: The function of one step for the rest (None: `single`,
            or one made here).

        Returns:
          The logs: the mean loss, the sync totals (read after the join)
          and `sync_steps_per_s`.
        """
        began = time.perf_counter()
        before = self._sync.step()
        epoch, first_step, steps_per_epoch = position
        loops_per_epoch, rest_steps = divmod(
            steps_per_epoch - first_step, self.steps_per_loop
        )
        if rest_steps and rest_fn is None:
            rest_fn = single or self._loop_function(steps=1)
        functions = [(loop, self.steps_per_loop)] * loops_per_epoch
        if single is not None and functions:
            functions[:1] = [(single, 1)] * self.steps_per_loop
        functions += [(rest_fn, 1)] * rest_steps
        plan = getattr(self.coordinator, "plan_epoch", None)
        if plan is not None:  # re-run functions add no update to the run
            pushes = loops_per_epoch * self.steps_per_loop + rest_steps
            plan(loop, pushes, self._run)
            if self.coordinator.in_plan(self._run):  # not the TF1 shim's
                for function in (single, rest_fn):
                    if function is not None:
                        self.coordinator.planned(function)
        self._cadence.epoch_begins(first_step)
        try:
            # The first loop's trace waits for its first single step where
            # the chief shares the workers' CPUs (see the function).
            wait = single is not None and loops.waits_for_first_step(
                ps_strategy.cluster_resolver(self.strategy),
                self.steps_per_loop,
            )
            results, done, lookahead = [], first_step, 0
            if self._cadence.every_seconds is not None:
                workers = cluster_coordinator.coordinator_workers(
                    self.coordinator
                )
                lookahead = 2 * len(workers)
            for function, steps in functions:
                if wait and function is loop:
                    loops.wait_for_first_step(results[0][0])
                    wait = False
                scheduled = self.coordinator.schedule(
                    function, args=(iterator,)
                )
                results.append((scheduled, steps))
                done += steps
                self._cadence.scheduled(scheduled, lookahead)
                self._maybe_save_inside(epoch, done, steps_per_epoch)
            loss = self._fetch_mean_loss(results)
            self.coordinator.join()
        except tf.errors.OutOfRangeError as e:
            raise ValueError(
                "The dataset of `dataset_fn` ran out on a worker: under "
                "ParameterServerStrategy each worker iterates its own copy "
                "for the whole `train` call, so it must repeat (add "
                "`.repeat()`; an epoch is `steps_per_epoch` steps). Epochs "
                "that ended before this one trained (and were checkpointed "
                "with `checkpoint_dir`)."
            ) from e
        seconds = time.perf_counter() - began
        totals = self._sync.totals()
        steps_done = totals["sync_steps"] - before
        logs = {"loss": loss, **totals}
        logs["sync_steps_per_s"] = steps_done / max(seconds, 1e-9)
        return logs

    def _maybe_save_inside(self, epoch, done, steps_per_epoch):
        """Joins and saves `ckpt-<epoch>_<done>` where a save inside the
        epoch is due (`checkpoint_every_*`; the epoch's end saves its
        own)."""
        if not (self._saver and self._cadence) or done >= steps_per_epoch:
            return
        if self._cadence.due(done):
            self.coordinator.join()
            self._saver.save(f"{epoch}_{done}")
            self._cadence.saved(done)

    def _run_pass(self, loop, iterator):
        """Runs one `ServicePassPerEpoch` epoch (`data_service`, 4.-5.).

        Keeps two functions per worker scheduled until every worker has
        returned one whose pass ended (or, should a worker never come back,
        until `4 x workers` functions in a row ran no step once one had
        ended: fetched in order, a function still running on a live
        worker holds that count back). Then joins and applies the last
        step's pushes (`Aggregator.flush`).
        """
        began = time.perf_counter()
        before = self._sync.step()
        self.coordinator.lift_plan()  # re-runs read new elements anyway
        workers = len(cluster_coordinator.coordinator_workers(self.coordinator))
        pending = collections.deque(
            self.coordinator.schedule(loop, args=(iterator,))
            for _ in range(2 * workers)
        )
        ended, idle, total, ran = set(), 0, 0.0, 0
        while pending:
            loss, steps, worker, done = pending.popleft().fetch()
            total, ran = total + float(loss), ran + int(steps)
            if done:
                ended.add(int(worker))
            idle = 0 if steps else idle + 1
            if len(ended) < workers and not (ended and idle >= 4 * workers):
                pending.append(
                    self.coordinator.schedule(loop, args=(iterator,))
                )
        self.coordinator.join()
        aggregator = coordinator_lib.core_aggregator(self.strategy)
        if aggregator is not None:
            aggregator.flush()
        seconds = time.perf_counter() - began
        totals = self._sync.totals()
        steps_done = totals["sync_steps"] - before
        logs = {"loss": total / max(ran, 1), **totals}
        logs["sync_steps_per_s"] = steps_done / max(seconds, 1e-9)
        logs["pass_steps"] = ran
        return logs

    def _fetch_mean_loss(self, results):
        """The mean loss of the steps of `results` (`(RemoteValue, steps)`,
        each function's loss the mean of its steps'), fetched in order;
        with `verbose=1` a bar counting loops of `steps_per_loop` steps, or
        steps where the epoch is not a whole number of loops."""
        bar, unit = None, 1
        if self._verbose == 1:
            steps_total = sum(s for _, s in results)
            # Loops, or steps where the epoch ends short of a loop.
            if steps_total % self.steps_per_loop == 0:
                unit = self.steps_per_loop
            bar = tf_keras.utils.Progbar(
                steps_total // unit,
                unit_name="loop" if unit > 1 else "step",
                stateful_metrics=["loss"],
            )
        done, total = 0, 0.0
        for result, steps in results:
            done += steps
            total += float(result.fetch()) * steps
            if bar:  # the mean loss of the steps so far
                bar.update(done // unit, [("loss", total / done)])
        return total / done

    def _end_epoch(self, epoch, epochs, logs):
        """Counts `epoch` done, checkpoints it, and with `verbose=2` logs it."""
        self._epoch.assign(epoch + 1)
        if self._saver:
            self._saver.save(epoch + 1)
            self._cadence.saved(0)
        if self._verbose == 2:
            show_all = any(
                c.show_all
                for c in self._callbacks
                if isinstance(c, callbacks_lib.SyncMetrics)
            )
            shown = logs if show_all else callbacks_lib.epoch_line(logs)
            print(
                f"epoch {epoch + 1}/{epochs} "
                + " ".join(f"{k}={v:.4g}" for k, v in shown.items()),
                flush=True,
            )
