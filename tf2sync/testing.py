"""Test utilities: local clusters on 127.0.0.1."""

from tf2sync._src.cluster import cluster_spec_dict
from tf2sync._src.cluster import local_cluster
from tf2sync._src.cluster import pick_free_ports

__all__ = ["cluster_spec_dict", "local_cluster", "pick_free_ports"]
