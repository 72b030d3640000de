"""Error-compensated 1-bit compression: the pure math of the compressed allreduce (no Horovod).

Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed" (arXiv:2102.02888), Algorithm 1, and its compressed allreduce (Section 4; DeepSpeed's
``compressed_allreduce``, ``deepspeed/runtime/comm/nccl.py``, by the same authors). For one tensor
x_i on each of n ranks, with worker error delta_i and, on the rank that serves part j, server
error delta_bar_j (both start at 0):

1. worker (every rank i): ``u = x_i + delta_i``; ``c_i = C[u]``; ``delta_i <- u - c_i``;
   ``c_i`` is cut into n parts and part j is sent to rank j (``alltoall``);
2. server (rank j, for part j): ``s = (1/n) sum_i c_i[j] + delta_bar_j``; ``c = C[s]``;
   ``delta_bar_j <- s - c``; ``c`` is sent to every rank (``allgather``);
3. every rank concatenates the n compressed parts: the result, the same on every rank.

The compressor C keeps one sign bit per element and one fp32 scale per *chunk* of ``chunk``
consecutive elements: ``C[x]_k = s_c sign(x_k)`` with ``s_c = ||x_c||_2 / sqrt(|c|)`` (the
compressed chunk has the norm of the original: the paper's "magnitude of the compensated
momentum over the magnitude of the quantized momentum"); sign(0) = +1. Signs travel packed 8 per
uint8 byte (bit 1 = non-negative, most significant bit first, as ``numpy.packbits``); scales
travel as their 4 fp32 bytes after the signs of the same part, so each collective moves one uint8
buffer.

Any world size n and tensor size N: each rank serves a part of ``P = ceil(N / n)`` elements
rounded up to a multiple of 8; the tail of the flat buffer (n P - N elements) is padding, kept at
exactly 0 in the values and the error buffers, and left out of every scale (a chunk's scale uses
its count of real elements; a chunk of padding only has scale 0).

Error feedback gives, after T rounds, the identity (per element, any inputs)::

    sum_t out_t = sum_t mean_i x_{i,t} - mean_i delta_{i,T} - delta_bar_T

so while the errors stay bounded the running mean of the outputs converges to the running mean of
the exact averages at rate O(1/T) (``tests/test_onebit.py`` checks this against numpy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Sign bits per byte; bit weights of one byte, most significant first (``numpy.packbits``).
BITS = 8
_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
#: Bytes of one fp32 scale.
SCALE_BYTES = 4
#: Default elements per fp32 scale: 256 sign bytes + 4 scale bytes, 31.5x less than fp32.
DEFAULT_CHUNK = 2048


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of ``x`` (float, [N]) packed 8 per byte: uint8 [ceil(N / 8)]; bit 1 where
    ``x >= 0`` (sign(0) = +1), the first element in the most significant bit (``numpy.packbits``
    order); a partial last byte is padded with 0 bits."""
    bits = (x.reshape(-1) >= 0).to(torch.uint8)
    pad = (-bits.numel()) % BITS
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, BITS) * _WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: float32 [n] of +1 / -1.

    Raises:
        ValueError: ``packed`` holds fewer than n bits.
    """
    if packed.numel() * BITS < n:
        raise ValueError(f"{packed.numel()} bytes hold {packed.numel() * BITS} signs, not {n}")
    bits = (packed.reshape(-1, 1) & _WEIGHTS.to(packed.device)) != 0
    return bits.reshape(-1)[:n].to(torch.float32) * 2 - 1


def chunk_scales(x: torch.Tensor, chunk: int, valid: int | None = None) -> torch.Tensor:
    """One scale per chunk of ``chunk`` elements of ``x`` (float, [N]): ``||x_c||_2 / sqrt(m_c)``
    with m_c the chunk's real elements (the first ``valid`` of x are real, the rest padding that
    must be 0); 0 for a chunk without real elements. Returns float32 [ceil(N / chunk)]."""
    n = x.numel()
    valid = n if valid is None else valid
    count = math.ceil(n / chunk)
    pad = count * chunk - n
    xx = torch.cat([x.reshape(-1).float(), x.new_zeros(pad, dtype=torch.float32)]) if pad else \
        x.reshape(-1).float()
    norms = torch.linalg.vector_norm(xx.view(count, chunk), dim=1)
    starts = torch.arange(count, dtype=torch.float32) * chunk
    real = (valid - starts).clamp(0, chunk)
    return torch.where(real > 0, norms / real.clamp(min=1).sqrt(), torch.zeros_like(norms))


@dataclass(frozen=True)
class Layout:
    """How a flat tensor of ``numel`` elements is cut for n ranks.

    Attributes:
        numel: N, real elements.
        world_size: n ranks.
        chunk: elements per fp32 scale (0: one scale per rank's part).
    """

    numel: int
    world_size: int
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        if self.numel < 1 or self.world_size < 1 or self.chunk < 0:
            raise ValueError(f"need numel >= 1, world_size >= 1, chunk >= 0; got {self.numel}, "
                             f"{self.world_size}, {self.chunk}")

    @property
    def part(self) -> int:
        """P: elements each rank serves, ceil(N / n) rounded up to a multiple of 8."""
        return BITS * math.ceil(math.ceil(self.numel / self.world_size) / BITS)

    @property
    def padded(self) -> int:
        """n P: the padded flat length (the worker error's length)."""
        return self.part * self.world_size

    @property
    def chunk_elems(self) -> int:
        """Elements per scale (``chunk``, or P when ``chunk`` is 0)."""
        return self.chunk or self.part

    @property
    def scales_per_part(self) -> int:
        """fp32 scales in one part: ceil(P / chunk)."""
        return math.ceil(self.part / self.chunk_elems)

    @property
    def part_bytes(self) -> int:
        """Bytes of one compressed part: P / 8 sign bytes + 4 bytes per scale."""
        return self.part // BITS + SCALE_BYTES * self.scales_per_part

    def valid(self, rank: int) -> int:
        """Real (non-padding) elements of rank ``rank``'s part."""
        return max(0, min(self.part, self.numel - rank * self.part))

    def wire_bytes(self) -> int:
        """Bytes one rank sends per compressed allreduce: n - 1 parts in the ``alltoall`` (its own
        part stays local) and n - 1 parts in a ring ``allgather`` (each rank forwards every other
        part once); 0 for one rank."""
        return 2 * (self.world_size - 1) * self.part_bytes


def encode(x: torch.Tensor, layout: Layout, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress one part x (float32 [P], the first ``valid`` real): (uint8 [part_bytes] = packed
    signs then the scales' bytes, the decompressed value C[x] float32 [P], 0 on padding)."""
    scales = chunk_scales(x, layout.chunk_elems, valid)
    wire = torch.cat([pack_signs(x), scales.view(torch.uint8)])
    return wire, _expand(torch.where(x >= 0, 1.0, -1.0), scales, layout, valid)


def decode(wire: torch.Tensor, layout: Layout, valid: int | None = None) -> torch.Tensor:
    """Decompress one part: uint8 [part_bytes] -> float32 [P] (0 beyond ``valid``; a scale-0
    chunk, e.g. padding, decodes to 0)."""
    nsign = layout.part // BITS
    signs = unpack_signs(wire[:nsign], layout.part)
    scales = wire[nsign:].clone().view(torch.float32)  # clone: fp32-aligned storage
    return _expand(signs, scales, layout, layout.part if valid is None else valid)


def _expand(signs: torch.Tensor, scales: torch.Tensor, layout: Layout, valid: int) -> torch.Tensor:
    per = torch.repeat_interleave(scales, layout.chunk_elems)[:layout.part]
    out = signs * per
    if valid < layout.part:
        out[valid:] = 0
    return out


class ErrorFeedback:
    """One rank's error buffers for a compressed allreduce of a fixed :class:`Layout`.

    Attributes:
        layout: the cut.
        rank: this rank.
        worker_error: delta_i, float32 [n P] (0 on padding).
        server_error: delta_bar of this rank's part, float32 [P] (0 on padding).
    """

    def __init__(self, layout: Layout, rank: int, device: torch.device | str = "cpu"):
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} outside 0..{layout.world_size - 1}")
        self.layout = layout
        self.rank = rank
        self.worker_error = torch.zeros(layout.padded, device=device)
        self.server_error = torch.zeros(layout.part, device=device)

    def worker_compress(self, x: torch.Tensor) -> torch.Tensor:
        """Step 1 on this rank: add the worker error to x (float, [N]), compress each rank's part,
        update the worker error. Returns uint8 [n, part_bytes], row j for rank j."""
        lay = self.layout
        if x.numel() != lay.numel:
            raise ValueError(f"tensor has {x.numel()} elements, layout expects {lay.numel}")
        u = self.worker_error.clone()
        u[:lay.numel] += x.reshape(-1).float()
        rows, approx = [], []
        for j in range(lay.world_size):
            w, c = encode(u[j * lay.part:(j + 1) * lay.part], lay, lay.valid(j))
            rows.append(w)
            approx.append(c)
        self.worker_error = u - torch.cat(approx)
        return torch.stack(rows)

    def server_reduce(self, received: torch.Tensor) -> torch.Tensor:
        """Step 2 on this rank: ``received`` uint8 [n, part_bytes] (row i from rank i, all for this
        rank's part) -> the mean plus the server error, compressed: uint8 [part_bytes]; updates
        the server error."""
        lay = self.layout
        valid = lay.valid(self.rank)
        s = torch.stack([decode(received[i], lay, valid) for i in range(lay.world_size)]).mean(0)
        s = s + self.server_error
        wire, c = encode(s, lay, valid)
        self.server_error = s - c
        return wire

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """Step 3: uint8 [n, part_bytes] (row j = rank j's compressed part) -> float32 [N]."""
        lay = self.layout
        return torch.cat([decode(gathered[j], lay, lay.valid(j))
                          for j in range(lay.world_size)])[:lay.numel]


def ring_allreduce_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes`` (reduce-scatter + allgather,
    2(n-1)/n of the buffer; Thakur et al. 2005); 0 for one rank."""
    return 2 * (world_size - 1) * nbytes // world_size
