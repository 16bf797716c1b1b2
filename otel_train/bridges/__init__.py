"""Bridges: sinks fed at each flush from the OTel SDK through the StepReader."""
