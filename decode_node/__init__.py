"""The decode node service."""
