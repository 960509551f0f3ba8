"""TensorFlow's TF1 mnist_replica.py, ported to a tf2sync job (`job.py`)."""
