"""Start kvroom services as real processes on 127.0.0.1: for the demo, the tests and the benchmark."""
