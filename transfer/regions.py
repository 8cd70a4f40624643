"""Memory regions (layered row arrays at fixed addresses) and the coalescing of token rows into contiguous runs.

A region is what one side exposes for one kind of per-token data, e.g. "kv" (MLA rows), "index_keys",
"index_scales": `num_layers` layers at `layer_stride_bytes` apart, each `num_rows` rows of `row_bytes`. Both
sides hold regions of the same names and row bytes; a transfer of token rows writes, for every region and layer,
one entry per contiguous run of (src_row -> dst_row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MemoryRegion:
    name: str
    base_ptr: int
    num_layers: int
    layer_stride_bytes: int
    row_bytes: int
    num_rows: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.row_bytes < 1 or self.num_rows < 1:
            raise ValueError(f"region {self.name!r}: num_layers, row_bytes and num_rows must be >= 1")
        if self.num_layers > 1 and self.layer_stride_bytes < self.num_rows * self.row_bytes:
            raise ValueError(
                f"region {self.name!r}: layer stride {self.layer_stride_bytes} B is smaller than a layer "
                f"({self.num_rows} rows x {self.row_bytes} B)"
            )

    @property
    def nbytes(self) -> int:
        """Bytes from the first row of layer 0 to the end of the last row of the last layer (what to register)."""
        return (self.num_layers - 1) * self.layer_stride_bytes + self.num_rows * self.row_bytes

    def address(self, layer: int, row: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= row < self.num_rows):
            raise IndexError(f"region {self.name!r}: (layer {layer}, row {row}) out of range "
                             f"({self.num_layers} layers, {self.num_rows} rows)")
        return self.base_ptr + layer * self.layer_stride_bytes + row * self.row_bytes

    def describe(self) -> dict[str, int]:
        """What a peer needs to compute our addresses (sent at registration)."""
        return {"base_ptr": self.base_ptr, "num_layers": self.num_layers,
                "layer_stride_bytes": self.layer_stride_bytes, "row_bytes": self.row_bytes,
                "num_rows": self.num_rows}

    @classmethod
    def from_description(cls, name: str, d: dict[str, int]) -> MemoryRegion:
        return cls(name=name, base_ptr=int(d["base_ptr"]), num_layers=int(d["num_layers"]),
                   layer_stride_bytes=int(d["layer_stride_bytes"]), row_bytes=int(d["row_bytes"]),
                   num_rows=int(d["num_rows"]))

    @classmethod
    def from_array(cls, name: str, array: Any) -> MemoryRegion:
        """A region over a [layers, rows, ...] torch tensor or numpy array whose rows are contiguous.

        Duck-typed (no torch import here): a row is everything after the first two dimensions ([L, N] gives
        rows of one element, e.g. one float32 scale per token).
        """
        if hasattr(array, "data_ptr"):  # torch.Tensor
            shape, itemsize = tuple(array.shape), array.element_size()
            strides = tuple(s * itemsize for s in array.stride())
            base = array.data_ptr()
        else:  # numpy.ndarray
            shape, itemsize, strides = tuple(array.shape), array.itemsize, tuple(array.strides)
            base = array.ctypes.data
        if len(shape) < 2:
            raise ValueError(f"region {name!r}: need a [layers, rows, ...] array, got shape {shape}")
        row_bytes = itemsize
        for dim in shape[2:]:
            row_bytes *= dim
        expected = itemsize
        for dim, stride in zip(reversed(shape[1:]), reversed(strides[1:]), strict=True):
            if dim > 1 and stride != expected:
                raise ValueError(f"region {name!r}: rows must be dense and contiguous (shape {shape}, "
                                 f"byte strides {strides})")
            expected *= dim
        return cls(name=name, base_ptr=base, num_layers=shape[0], layer_stride_bytes=strides[0],
                   row_bytes=row_bytes, num_rows=shape[1])


def coalesce_runs(src_rows: Sequence[int], dst_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group token i's (src_rows[i] -> dst_rows[i]) into maximal runs where both sides advance by one row.

    Returns [(src_start, dst_start, n)], in token order: one transfer entry per run instead of per row.
    """
    if len(src_rows) != len(dst_rows):
        raise ValueError(f"{len(src_rows)} source rows but {len(dst_rows)} destination rows")
    runs: list[tuple[int, int, int]] = []
    if not src_rows:
        return runs
    start_s, start_d, n = int(src_rows[0]), int(dst_rows[0]), 1
    for s, d in zip(src_rows[1:], dst_rows[1:], strict=True):
        s, d = int(s), int(d)
        if s == start_s + n and d == start_d + n:
            n += 1
        else:
            runs.append((start_s, start_d, n))
            start_s, start_d, n = s, d, 1
    runs.append((start_s, start_d, n))
    return runs


def run_entries(
    src: MemoryRegion, dst: MemoryRegion, runs: Sequence[tuple[int, int, int]]
) -> tuple[list[int], list[int], list[int]]:
    """Transfer entries (src_ptrs, dst_ptrs, lengths) for `runs` in every layer of one region pair."""
    if src.row_bytes != dst.row_bytes or src.num_layers != dst.num_layers:
        raise ValueError(f"region {src.name!r}: source ({src.num_layers} layers x {src.row_bytes} B rows) and "
                         f"destination ({dst.num_layers} layers x {dst.row_bytes} B rows) differ")
    for s, d, n in runs:
        if s < 0 or d < 0 or s + n > src.num_rows or d + n > dst.num_rows:
            raise IndexError(f"region {src.name!r}: run src {s}..{s + n - 1} -> dst {d}..{d + n - 1} is outside "
                             f"the regions ({src.num_rows} source rows, {dst.num_rows} destination rows)")
    rb = src.row_bytes
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for layer in range(src.num_layers):
        sb = src.base_ptr + layer * src.layer_stride_bytes
        db = dst.base_ptr + layer * dst.layer_stride_bytes
        for s, d, n in runs:
            srcs.append(sb + s * rb)
            dsts.append(db + d * rb)
            lens.append(n * rb)
    return srcs, dsts, lens
