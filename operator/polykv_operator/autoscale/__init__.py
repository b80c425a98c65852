"""Autoscaling a PolyKVEngine: the fleet's signal from its replicas' own figures, served as
JSON (KEDA's metrics-api scaler), as the operator's own external.metrics.k8s.io API (an
HPA), and as Prometheus gauges (metrics.py); and the pod deletion cost that makes a scale-down
remove the replica with the fewest sessions. Each module has one job and its own layer (see
docs/architecture.md): pure modules compute, I/O modules serve."""
