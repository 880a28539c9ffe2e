"""Leaves every layer builds on: a file's identity (identity.py), tensor names and layouts
(names.py), sizes (units.py), the garbage collector paused (gcpause.py), progress lines (progress.py)."""
