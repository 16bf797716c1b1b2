"""Shared test helpers: real components, fakes, recording doubles and multi-rank launchers."""
