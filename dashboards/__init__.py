"""Grafana dashboards for otel_train, generated from the metric catalogue (`dashboards/build.py`)."""
