"""The prefill node service."""
