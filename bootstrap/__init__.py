"""The bootstrap service: node registry, room placement and status."""
