"""The kinds of page digest, apart from ``digest`` so the wire protocol can name them without torch."""

from typing import Literal

DigestKind = Literal["xxh3", "wsum"]  # verify mode's page digests (shared.kv.digest)
