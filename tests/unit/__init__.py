"""Tests without processes of their own: each module in one process, fakes for the engine."""
