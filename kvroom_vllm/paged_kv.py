"""vLLM's paged KV cache as kvroom moves it: one registered region, a layer after another.

vLLM gives the connector one tensor per attention layer, logically ``[blocks, heads, tokens,
K|V]`` (its ``LBHNC`` layout: a block of a layer is contiguous, head-major), the layers of one
allocation a fixed stride apart. A room's KV is then, for each layer, the prompt's blocks; the
heads one rank writes into another are one contiguous range of each block. So a transfer is
kvroom's page plan (``shared.kv.layout.plan_writes``) once per layer, with a vLLM block as the page.
"""

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import xxhash

from shared.kv.head_split import HeadRange
from shared.kv.layout import Write, plan_writes


@dataclass(frozen=True)
class PagedKV:
    """One rank's KV cache: ``num_layers`` regions ``layer_stride`` bytes apart from ``base``, each
    ``num_blocks`` blocks of ``block_bytes`` holding ``heads`` (the KV heads this rank holds)."""

    base: int
    num_layers: int
    layer_stride: int
    num_blocks: int
    block_bytes: int
    heads: HeadRange
    on_host: bool = True  # in host memory (a CPU KV cache), where verify mode reads it

    @property
    def head_bytes(self) -> int:
        return self.block_bytes // self.heads.count

    @property
    def nbytes(self) -> int:
        """From the first layer's first block to the last layer's last: what the engine registers."""
        return (self.num_layers - 1) * self.layer_stride + self.num_blocks * self.block_bytes


def paged_kv(kv_caches: Mapping[str, torch.Tensor], heads: HeadRange) -> PagedKV:
    """The layers vLLM registered, as one region; ValueError says why they cannot be one."""
    layers = sorted(kv_caches.values(), key=lambda t: t.data_ptr())
    if not layers:
        raise ValueError("vLLM registered no KV cache layers")
    first = layers[0]
    if first.dim() != 4:
        raise ValueError(
            f"a KV cache layer of shape {tuple(first.shape)}; kvroom takes [blocks, heads, tokens, K|V]"
        )
    for layer in layers:
        if layer.shape != first.shape or layer.dtype != first.dtype or not layer.is_contiguous():
            raise ValueError(
                "KV cache layers differ in shape or dtype, or one is not contiguous "
                "(kvroom takes vLLM's head-major block layout, LBHNC)"
            )
    num_blocks, num_heads = first.shape[0], first.shape[1]
    if num_heads != heads.count:
        raise ValueError(f"the KV cache holds {num_heads} heads, this rank should hold {heads.count}")
    block_bytes = first[0].numel() * first.element_size()
    stride = layers[1].data_ptr() - first.data_ptr() if len(layers) > 1 else num_blocks * block_bytes
    for index, layer in enumerate(layers):
        if layer.data_ptr() != first.data_ptr() + index * stride:
            raise ValueError("the KV cache layers are not one allocation a fixed stride apart")
    if stride < num_blocks * block_bytes:
        raise ValueError("KV cache layers overlap")
    return PagedKV(first.data_ptr(), len(layers), stride, num_blocks, block_bytes, heads, not first.is_cuda)


def plan_layers(
    src: PagedKV,
    src_blocks: list[int],
    dst_base: int,
    dst_layer_stride: int,
    dst_block_bytes: int,
    dst_heads: HeadRange,
    dst_blocks: list[int],
    written: HeadRange,
) -> list[Write]:
    """The writes that copy heads ``written`` of ``src_blocks`` into ``dst_blocks`` of a peer rank
    holding ``dst_heads``, layer by layer."""
    offset_src = (written.start - src.heads.start) * src.head_bytes
    offset_dst = (written.start - dst_heads.start) * src.head_bytes
    length = written.count * src.head_bytes
    writes: list[Write] = []
    for layer in range(src.num_layers):
        writes += plan_writes(
            src.base + layer * src.layer_stride,
            src.block_bytes,
            src_blocks,
            dst_base + layer * dst_layer_stride,
            dst_block_bytes,
            dst_blocks,
            offset_src,
            offset_dst,
            length,
        )
    return writes


def host_bytes(kv: PagedKV) -> memoryview:
    """The region as bytes, for verify mode's digests; the KV cache must be in host memory."""
    return memoryview((ctypes.c_uint8 * kv.nbytes).from_address(kv.base)).cast("B")


def block_digests(kv: PagedKV, data: memoryview, blocks: list[int], heads: HeadRange) -> list[int]:
    """One digest per block of ``blocks``: XXH3-64 over the bytes of ``heads`` in that block of every
    layer, in layer order, signed as the wire carries it (``shared.kv.digest``'s ``xxh3`` kind)."""
    offset = (heads.start - kv.heads.start) * kv.head_bytes
    length = heads.count * kv.head_bytes
    out = []
    for block in blocks:
        digest = xxhash.xxh3_64()
        for layer in range(kv.num_layers):
            at = layer * kv.layer_stride + block * kv.block_bytes + offset
            digest.update(data[at : at + length])
        value = digest.intdigest()
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out
