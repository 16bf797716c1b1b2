"""Fault injection: signals, hostile values and names, full disks, planted secrets, thread races."""
