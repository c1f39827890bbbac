"""Observers of a run: what a logger, a metrics endpoint or a Python caller sees of it.

Owns the ``Observer`` interface and its batching, the loggers (TensorBoard, W&B, MLflow) and the
Prometheus endpoint with the JSON log format. May import: ps.core, protocol/ (nothing that
drives a run: the daemon imports this package, never the other way).
"""
