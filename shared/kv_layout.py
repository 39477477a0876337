"""The shape of one KV page, which both sides of a transfer must agree on."""

import msgspec
import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class KVLayout(msgspec.Struct, frozen=True):
    """One page holds ``page_size`` tokens of K and V for every layer.

    Pages are the outermost dimension of the pool, so a run of consecutive
    pages is one contiguous byte range and moves as one engine transfer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * self.torch_dtype.itemsize

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def mismatch(self, other: "KVLayout") -> str | None:
        """A reason the two layouts cannot exchange pages, or None if they can."""
        for field in self.__struct_fields__:
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"{field} differs: {mine} != {theirs}"
        return None
