"""KV memory and how it moves.

Reading path: ``layout`` (pages, per-layer regions, the page-capacity rule), ``pool`` (the
registered memory and its free pages), ``head_split`` (which KV heads a rank holds under
tensor parallelism), ``aux_buffers`` (the aux record slots), ``transfer`` (the engine
interface and its Mooncake implementation), ``digest`` (page digests for verified KV).
"""
