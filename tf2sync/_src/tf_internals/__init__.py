"""Every private TensorFlow / tf_keras API tf2sync uses, behind one door.

No other module of tf2sync imports `tensorflow.python` or `tf_keras.src`
(`tests/lint_test.py` checks) or reads a private attribute of a TF or
tf_keras object. Each name here says (a) the public API it stands in for,
or why there is none, and (b) the versions it was checked on, as a tag:

* `[2.21]`: read and tested on TF 2.21.0 with tf_keras 2.21.0 (`.venv`).
* `[2.15: kept]`: TF 2.15.1 with tf_keras 2.15 and tensorflow-addons, the
  CI's second environment (`requirements-tfa.txt`), whose sources were not
  at hand here: the 2.15 path is the one the previous code, run by that
  CI, had.

A section's tag applies to each of its names unless the name has its own.
When a TF or tf_keras upgrade breaks tf2sync, the break is in this package.

One module per part of TensorFlow that tf2sync reaches into; the rest of
tf2sync imports only this package (`tf_internals.<name>`), which
re-exports every name:

* `graph_ops`: rewiring a traced step's graph (the step's copies).
* `ps_strategy`: ParameterServerStrategy's variables, read cache,
  extended class and datasets.
* `cluster_coordinator`: the coordinator's workers, closures and
  per-worker datasets, and `fit`'s data handler.
* `runtime`: whether this process started TensorFlow's runtime.
* `autograph`: what AutoGraph converts of tf2sync's code and the user's.
* `keras_training`: the pieces of `fit`'s train function.
* `keras_optimizers`: both tf_keras optimizer families and the TF1
  shim's `tf.compat.v1.train` optimizers.
* `mixed_precision`: loss scaling, autocast and tf_keras's weight files.
* `data_service`: the tf.data service.
"""

from __future__ import annotations

from tf2sync._src.tf_internals.autograph import convert_as_caller
from tf2sync._src.tf_internals.autograph import function_of_tf2sync
from tf2sync._src.tf_internals.autograph import skip_autograph_for_tf2sync
from tf2sync._src.tf_internals.cluster_coordinator import after_each_epoch_join
from tf2sync._src.tf_internals.cluster_coordinator import caller_self_of_type
from tf2sync._src.tf_internals.cluster_coordinator import coordinator_workers
from tf2sync._src.tf_internals.cluster_coordinator import (
    data_handler_dataset_creator,
)
from tf2sync._src.tf_internals.cluster_coordinator import data_handler_model
from tf2sync._src.tf_internals.cluster_coordinator import (
    indexed_per_worker_dataset,
)
from tf2sync._src.tf_internals.cluster_coordinator import inflight_closures
from tf2sync._src.tf_internals.cluster_coordinator import keras_entry_point
from tf2sync._src.tf_internals.cluster_coordinator import (
    new_iterator_each_epoch,
)
from tf2sync._src.tf_internals.cluster_coordinator import on_worker_failure
from tf2sync._src.tf_internals.cluster_coordinator import strategy_coordinator
from tf2sync._src.tf_internals.cluster_coordinator import take_over_closure
from tf2sync._src.tf_internals.cluster_coordinator import track_closures
from tf2sync._src.tf_internals.cluster_coordinator import worker_pinger
from tf2sync._src.tf_internals.cluster_coordinator import worker_slice_specs
from tf2sync._src.tf_internals.data_service import dispatcher_num_workers
from tf2sync._src.tf_internals.data_service import service_dataset_of_job
from tf2sync._src.tf_internals.graph_ops import add_control_inputs
from tf2sync._src.tf_internals.graph_ops import copies_like_traces
from tf2sync._src.tf_internals.graph_ops import inline_copy
from tf2sync._src.tf_internals.graph_ops import op_is_stateful
from tf2sync._src.tf_internals.graph_ops import replace_control_inputs
from tf2sync._src.tf_internals.graph_ops import update_op_input
from tf2sync._src.tf_internals.keras_optimizers import created_step_variable
from tf2sync._src.tf_internals.keras_optimizers import is_tfa_multi_optimizer
from tf2sync._src.tf_internals.keras_optimizers import is_trackable
from tf2sync._src.tf_internals.keras_optimizers import legacy_apply_dense
from tf2sync._src.tf_internals.keras_optimizers import legacy_apply_sparse
from tf2sync._src.tf_internals.keras_optimizers import legacy_create_all_weights
from tf2sync._src.tf_internals.keras_optimizers import legacy_distributed_apply
from tf2sync._src.tf_internals.keras_optimizers import legacy_prepare
from tf2sync._src.tf_internals.keras_optimizers import (
    legacy_sparse_dedup_is_plain,
)
from tf2sync._src.tf_internals.keras_optimizers import (
    legacy_transform_gradients,
)
from tf2sync._src.tf_internals.keras_optimizers import new_apply_weight_decay
from tf2sync._src.tf_internals.keras_optimizers import new_clip_gradients
from tf2sync._src.tf_internals.keras_optimizers import new_compute_learning_rate
from tf2sync._src.tf_internals.keras_optimizers import new_distributed_apply
from tf2sync._src.tf_internals.keras_optimizers import (
    new_learning_rate_uncomputed,
)
from tf2sync._src.tf_internals.keras_optimizers import (
    new_update_moving_averages,
)
from tf2sync._src.tf_internals.keras_optimizers import new_update_step
from tf2sync._src.tf_internals.keras_optimizers import optimizer_name
from tf2sync._src.tf_internals.keras_optimizers import standalone_keras_2_loaded
from tf2sync._src.tf_internals.keras_optimizers import tf1_optimizer_apply
from tf2sync._src.tf_internals.keras_optimizers import (
    tf1_optimizer_create_slots,
)
from tf2sync._src.tf_internals.keras_optimizers import tf1_optimizer_variables
from tf2sync._src.tf_internals.keras_optimizers import track_child
from tf2sync._src.tf_internals.keras_optimizers import tracks_child
from tf2sync._src.tf_internals.keras_training import (
    data_handler_steps_per_execution,
)
from tf2sync._src.tf_internals.keras_training import epoch_logs_validator
from tf2sync._src.tf_internals.keras_training import fit_epoch_position
from tf2sync._src.tf_internals.keras_training import is_keras_train_step
from tf2sync._src.tf_internals.keras_training import minimum_control_deps
from tf2sync._src.tf_internals.keras_training import model_coordinator
from tf2sync._src.tf_internals.keras_training import (
    override_epoch_logs_validator,
)
from tf2sync._src.tf_internals.keras_training import reduce_per_replica
from tf2sync._src.tf_internals.keras_training import (
    restore_epoch_logs_validator,
)
from tf2sync._src.tf_internals.keras_training import running_fit_callbacks
from tf2sync._src.tf_internals.keras_training import running_fit_data_handler
from tf2sync._src.tf_internals.keras_training import (
    set_data_handler_steps_per_execution,
)
from tf2sync._src.tf_internals.keras_training import (
    set_steps_per_execution_variable,
)
from tf2sync._src.tf_internals.keras_training import (
    steps_per_execution_variable,
)
from tf2sync._src.tf_internals.keras_training import train_counter
from tf2sync._src.tf_internals.mixed_precision import LegacyLossScaleOptimizer
from tf2sync._src.tf_internals.mixed_precision import dynamic_loss_scale_state
from tf2sync._src.tf_internals.mixed_precision import group_shards
from tf2sync._src.tf_internals.mixed_precision import (
    install_loss_scaling_predicate,
)
from tf2sync._src.tf_internals.mixed_precision import install_sharded_autocast
from tf2sync._src.tf_internals.mixed_precision import (
    install_whole_weights_in_keras_files,
)
from tf2sync._src.tf_internals.mixed_precision import (
    is_wrapped_by_loss_scale_optimizer,
)
from tf2sync._src.tf_internals.mixed_precision import (
    keras_supports_loss_scaling,
)
from tf2sync._src.tf_internals.mixed_precision import sharded_container
from tf2sync._src.tf_internals.ps_strategy import ParameterServerExtended
from tf2sync._src.tf_internals.ps_strategy import cached_read
from tf2sync._src.tf_internals.ps_strategy import clear_read_cache
from tf2sync._src.tf_internals.ps_strategy import distributed_dataset_is_built
from tf2sync._src.tf_internals.ps_strategy import distributed_dataset_source
from tf2sync._src.tf_internals.ps_strategy import in_read_caching_scope
from tf2sync._src.tf_internals.ps_strategy import inner_variable
from tf2sync._src.tf_internals.ps_strategy import is_caching_variable
from tf2sync._src.tf_internals.ps_strategy import is_distributed_dataset
from tf2sync._src.tf_internals.ps_strategy import is_sharded_variable
from tf2sync._src.tf_internals.ps_strategy import num_gpus_per_worker
from tf2sync._src.tf_internals.ps_strategy import num_workers
from tf2sync._src.tf_internals.ps_strategy import plain_resource_variable
from tf2sync._src.tf_internals.ps_strategy import read_caching_scope
from tf2sync._src.tf_internals.ps_strategy import replace_extended_class
from tf2sync._src.tf_internals.ps_strategy import shards
from tf2sync._src.tf_internals.ps_strategy import start_read_cache
from tf2sync._src.tf_internals.ps_strategy import worker_local_dataset
from tf2sync._src.tf_internals.runtime import runtime_started

__all__ = [
    "add_control_inputs",
    "copies_like_traces",
    "inline_copy",
    "op_is_stateful",
    "replace_control_inputs",
    "update_op_input",
    "ParameterServerExtended",
    "cached_read",
    "clear_read_cache",
    "distributed_dataset_is_built",
    "distributed_dataset_source",
    "in_read_caching_scope",
    "inner_variable",
    "is_caching_variable",
    "is_distributed_dataset",
    "is_sharded_variable",
    "num_gpus_per_worker",
    "num_workers",
    "plain_resource_variable",
    "read_caching_scope",
    "replace_extended_class",
    "shards",
    "start_read_cache",
    "worker_local_dataset",
    "after_each_epoch_join",
    "caller_self_of_type",
    "coordinator_workers",
    "data_handler_dataset_creator",
    "data_handler_model",
    "indexed_per_worker_dataset",
    "inflight_closures",
    "keras_entry_point",
    "new_iterator_each_epoch",
    "on_worker_failure",
    "strategy_coordinator",
    "take_over_closure",
    "track_closures",
    "worker_pinger",
    "worker_slice_specs",
    "runtime_started",
    "convert_as_caller",
    "function_of_tf2sync",
    "skip_autograph_for_tf2sync",
    "data_handler_steps_per_execution",
    "epoch_logs_validator",
    "fit_epoch_position",
    "is_keras_train_step",
    "minimum_control_deps",
    "model_coordinator",
    "override_epoch_logs_validator",
    "reduce_per_replica",
    "restore_epoch_logs_validator",
    "running_fit_callbacks",
    "running_fit_data_handler",
    "set_data_handler_steps_per_execution",
    "set_steps_per_execution_variable",
    "steps_per_execution_variable",
    "train_counter",
    "created_step_variable",
    "is_tfa_multi_optimizer",
    "is_trackable",
    "legacy_apply_dense",
    "legacy_apply_sparse",
    "legacy_create_all_weights",
    "legacy_distributed_apply",
    "legacy_prepare",
    "legacy_sparse_dedup_is_plain",
    "legacy_transform_gradients",
    "new_apply_weight_decay",
    "new_clip_gradients",
    "new_compute_learning_rate",
    "new_distributed_apply",
    "new_learning_rate_uncomputed",
    "new_update_moving_averages",
    "new_update_step",
    "optimizer_name",
    "standalone_keras_2_loaded",
    "tf1_optimizer_apply",
    "tf1_optimizer_create_slots",
    "tf1_optimizer_variables",
    "track_child",
    "tracks_child",
    "LegacyLossScaleOptimizer",
    "dynamic_loss_scale_state",
    "group_shards",
    "install_loss_scaling_predicate",
    "install_sharded_autocast",
    "install_whole_weights_in_keras_files",
    "is_wrapped_by_loss_scale_optimizer",
    "keras_supports_loss_scaling",
    "sharded_container",
    "dispatcher_num_workers",
    "service_dataset_of_job",
]
