"""Where KV comes from and what decodes from it.

Reading path: ``source`` (the ``KVSource`` interface and ``make_source``), ``reference`` (the
reference model), ``hf`` (Hugging Face models), ``synthetic`` (stamped pages for benchmarks),
``files`` (reading a checkpoint directory).
"""
