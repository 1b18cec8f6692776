"""Tools above the runtime that use several stages: ahead-of-time compilation (aot.py)."""
