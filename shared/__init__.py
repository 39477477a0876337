"""What the bootstrap, prefill and decode services share."""
