"""KV memory and how it moves.

Reading path: ``layout`` (pages, per-layer regions, the page-capacity rule), ``pool`` (the
registered memory and its free pages), ``lease`` (pages a decode rank lends to a prefill rank's
writes) and ``borrow`` (the prefill rank's side: what its writes into them may still do),
``head_split`` (which KV heads a rank holds under tensor parallelism), ``aux_buffers`` (the aux
record slots), ``transfer`` (the engine interface and its Mooncake implementation), ``digest``
(page digests for verified KV; ``digest_kind`` names their kinds without torch).
"""
