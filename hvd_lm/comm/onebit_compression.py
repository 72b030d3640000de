"""Error-compensated 1-bit compression: the math of the compressed allreduce, and the allreduce
itself on the engine's ``alltoall`` + ``allgather`` (:func:`compressed_allreduce`).

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
import torch.nn.functional as F

from hvd_lm.comm import engine

#: Sign bits per byte; bit weights of one byte, most significant first (``numpy.packbits``).
BITS = 8
_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
#: Bytes of one fp32 scale.
SCALE_BYTES = 4
#: Default elements per fp32 scale: 256 sign bytes + 4 scale bytes, 31.5x less than fp32.
DEFAULT_CHUNK = 2048


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of ``x`` (float, [..., N]) packed 8 per byte: uint8 [..., ceil(N / 8)]; bit 1
    where ``x >= 0`` (sign(0) = +1), the first element in the most significant bit
    (``numpy.packbits`` order); a partial last byte is padded with 0 bits."""
    bits = F.pad((x >= 0).to(torch.uint8), (0, (-x.shape[-1]) % BITS))
    return (bits.view(*bits.shape[:-1], -1, BITS) * _WEIGHTS.to(bits.device)).sum(
        -1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: uint8 [..., k] -> float32 [..., n] of +1 / -1.

    Raises:
        ValueError: ``packed`` holds fewer than n bits.
    """
    if packed.shape[-1] * BITS < n:
        raise ValueError(f"{packed.shape[-1]} bytes hold {packed.shape[-1] * BITS} signs, not {n}")
    bits = (packed.unsqueeze(-1) & _WEIGHTS.to(packed.device)) != 0
    return bits.flatten(-2)[..., :n].to(torch.float32) * 2 - 1


def chunk_scales(x: torch.Tensor, chunk: int, valid=None) -> torch.Tensor:
    """One scale per chunk of ``chunk`` elements of ``x`` (float, [..., N]):
    ``||x_c||_2 / sqrt(m_c)`` with m_c the chunk's real elements (the first ``valid`` of each row
    are real: an int, or an int64 tensor of x's leading shape; the rest padding that must be
    0); 0 for a chunk without real elements. Returns float32 [..., ceil(N / chunk)]."""
    n = x.shape[-1]
    count = math.ceil(n / chunk)
    xx = F.pad(x.float(), (0, count * chunk - n))
    norms = torch.linalg.vector_norm(xx.view(*x.shape[:-1], count, chunk), dim=-1)
    starts = torch.arange(count, device=x.device) * chunk
    real = (_column(n if valid is None else valid, x.device) - starts).clamp(0, chunk)
    return torch.where(real > 0, norms / real.clamp(min=1).float().sqrt(), torch.zeros_like(norms))


def _column(valid, device) -> torch.Tensor:
    """``valid`` (int or [...] tensor) as an int64 [..., 1] tensor, to compare with positions."""
    return torch.as_tensor(valid, dtype=torch.int64, device=device).unsqueeze(-1)


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
    def part_bytes(self) -> int:
        """Bytes of one compressed part: P / 8 sign bytes + 4 bytes per scale (ceil(P / chunk)
        fp32 scales)."""
        return self.part // BITS + SCALE_BYTES * math.ceil(self.part / self.chunk_elems)

    def valid(self, rank: int) -> int:
        """Real (non-padding) elements of rank ``rank``'s part."""
        return max(0, min(self.part, self.numel - rank * self.part))

    def wire_bytes(self) -> int:
        """Bytes one rank sends per compressed allreduce: n - 1 parts in the ``alltoall`` (its own
        part stays local) and n - 1 parts in a ring ``allgather`` (each rank forwards every other
        part once); 0 for one rank."""
        return 2 * (self.world_size - 1) * self.part_bytes


def encode(x: torch.Tensor, layout: Layout, valid) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress parts x (float32 [..., P], the first ``valid`` of each real: an int, or an int64
    tensor of x's leading shape): (uint8 [..., part_bytes] = packed signs then the scales'
    bytes, the decompressed value C[x] float32 [..., P], 0 on padding). All n parts of a rank
    go through one call (no loop over the world size)."""
    scales = chunk_scales(x, layout.chunk_elems, valid)
    wire = torch.cat([pack_signs(x), scales.view(torch.uint8)], dim=-1)
    return wire, _expand(torch.where(x >= 0, 1.0, -1.0), scales, layout, valid)


def decode(wire: torch.Tensor, layout: Layout, valid=None) -> torch.Tensor:
    """Decompress parts: uint8 [..., part_bytes] -> float32 [..., P] (0 beyond ``valid``, an int
    or an int64 tensor of the leading shape; a scale-0 chunk, e.g. padding, decodes to 0)."""
    nsign = layout.part // BITS
    signs = unpack_signs(wire[..., :nsign], layout.part)
    scales = wire[..., nsign:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return _expand(signs, scales, layout, layout.part if valid is None else valid)


def _expand(signs: torch.Tensor, scales: torch.Tensor, layout: Layout, valid) -> torch.Tensor:
    per = torch.repeat_interleave(scales, layout.chunk_elems, dim=-1)[..., :layout.part]
    real = torch.arange(layout.part, device=signs.device) < _column(valid, signs.device)
    return torch.where(real, signs * per, 0.0)


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
        self.layout, self.rank = layout, rank
        self.worker_error = torch.zeros(layout.padded, device=device)
        self.server_error = torch.zeros(layout.part, device=device)
        self._valid = torch.tensor([layout.valid(j) for j in range(layout.world_size)],
                                   device=device)  # real elements of each part, int64 [n]

    def worker_compress(self, x: torch.Tensor) -> torch.Tensor:
        """Step 1 on this rank: add the worker error to x (float, [N]), compress each rank's part,
        update the worker error. Returns uint8 [n, part_bytes], row j for rank j."""
        lay = self.layout
        if x.numel() != lay.numel:
            raise ValueError(f"tensor has {x.numel()} elements, layout expects {lay.numel}")
        u = self.worker_error.clone()
        u[:lay.numel] += x.reshape(-1).float()
        wire, approx = encode(u.view(lay.world_size, lay.part), lay, self._valid)
        self.worker_error = u - approx.reshape(-1)
        return wire

    def server_reduce(self, received: torch.Tensor) -> torch.Tensor:
        """Step 2 on this rank: ``received`` uint8 [n, part_bytes] (row i from rank i, all for this
        rank's part) -> the mean plus the server error, compressed: uint8 [part_bytes]; updates
        the server error."""
        valid = self.layout.valid(self.rank)
        s = decode(received, self.layout, valid).mean(0) + self.server_error
        wire, c = encode(s, self.layout, valid)
        self.server_error = s - c
        return wire

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """Step 3: uint8 [n, part_bytes] (row j = rank j's compressed part) -> float32 [N]."""
        return decode(gathered, self.layout, self._valid).reshape(-1)[:self.layout.numel]


def compressed_allreduce(x: torch.Tensor, errors: ErrorFeedback, name: str) -> torch.Tensor:
    """Average of ``x`` over all ranks through 1-bit compression with error feedback (Tang et al.
    2021, Algorithm 1's compressed allreduce): worker error added and every rank's part compressed
    (:meth:`ErrorFeedback.worker_compress`), an ``alltoall`` of the parts (uint8
    [n, part_bytes]: signs packed 8 per byte, then the fp32 scales), average of this rank's part
    plus the server error, recompressed (:meth:`ErrorFeedback.server_reduce`), an ``allgather``
    of the n compressed parts, decompressed (:meth:`ErrorFeedback.assemble`); the collectives
    on the engine's (:func:`hvd_lm.comm.engine.alltoall`, :func:`~hvd_lm.comm.engine.allgather`).

    Args:
        x: this rank's tensor, float [N] (N = ``errors.layout.numel``).
        errors: this rank's error buffers (updated in place); its layout fixes n and the chunk.
        name: prefix of the collectives' names (unique per tensor).

    Returns:
        float32 [N], identical on every rank.

    Raises:
        ValueError: x does not match the layout, or the layout's world size is not the engine's.
    """
    n = errors.layout.world_size
    send = errors.worker_compress(x)
    if n == 1:
        return errors.assemble(errors.server_reduce(send).unsqueeze(0))
    if n != engine.rank_context().size:
        raise ValueError(f"compressed allreduce laid out for {n} ranks, the engine has "
                         f"{engine.rank_context().size}")
    # collective: row i of what comes back is rank i's part for this rank
    part = errors.server_reduce(engine.alltoall(send, name=f"{name}.alltoall"))
    # collective: every rank's compressed part
    return errors.assemble(engine.allgather(part.unsqueeze(0), name=f"{name}.allgather"))
