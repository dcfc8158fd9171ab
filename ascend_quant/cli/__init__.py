"""Command-line interface (click): calibrate, eval, inspect, verify, serve, upload."""
