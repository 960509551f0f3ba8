"""Every private TensorFlow / tf_keras API tf2sync uses, one module per
TensorFlow or tf_keras subsystem it touches.

No module of tf2sync outside this package imports `tensorflow.python` or
`tf_keras.src` (`tests/lint_test.py` checks) or reads a private attribute
of a TF or tf_keras object, and none outside `patches` replaces a TF or
tf_keras function, method or class (`tests/patches_test.py` checks). Each
name here says (a) the public API it stands in for, or why there is none,
and (b) the versions it was checked on, as a tag:

* `[2.21]`: read and tested on TF 2.21.0 with tf_keras 2.21.0 (`.venv`).
* `[2.15: kept]`: TF 2.15.1 with tf_keras 2.15 and tensorflow-addons, the
  CI's second environment (`requirements-tfa.txt`), whose sources were not
  at hand here: the 2.15 path is the one the previous code, run by that
  CI, had.

A module's tag (in its docstring) applies to each of its names unless the
name has its own. When a TF or tf_keras upgrade breaks tf2sync, the break
is in this package:

* `graph_ops`: changing an op of a traced graph.
* `graph_copy`: copying a function's graph into another (`inline_copy`).
* `ps_variables`: PSS's variables, their read cache, sharded variables.
* `ps_strategy`: the PSS object: its extended class, workers, datasets.
* `cluster_coordinator`: the coordinator's workers, per-worker datasets,
  closure queue and pings.
* `closures`: moving a worker's in-flight closure (a copy of TF's
  `Worker._process_closure`).
* `keras_fit`: what tf_keras's `fit` and its data handlers are doing now.
* `keras_training`: the pieces of tf_keras's train function.
* `keras_optimizers`: both tf_keras optimizer families' kernels, and TF1's
  optimizers.
* `checkpoints`: optimizer slots in TF2 checkpoints.
* `mixed_precision`: loss scaling and autocast weights under PSS.
* `keras_saving`: sharded weights in `.keras` files.
* `autograph`: AutoGraph, and `tf.function` of tf2sync's own code.
* `tf_data_service`: tf.data service jobs and dispatchers.
* `runtime`: whether this process started TensorFlow's runtime.
* `patches`: every runtime patch tf2sync installs into TF or tf_keras,
  each with `install` and `uninstall`, in one registry.
* `fingerprints`: hashes of the TF and tf_keras sources tf2sync copies
  (`tests/fingerprints_test.py` checks them).
"""
